"""The CLI room: ``gpuprims-orchestrator`` (:mod:`.main`, :mod:`.node`, :mod:`.control`), ``gpuprims-engine``
(:mod:`.engine`), ``gpuprims doctor`` (:mod:`.doctor`) and the main job's demo (:mod:`.demo`)."""
