"""The config room: the apps.yaml schema (:mod:`.schema`) and model files as apps (:mod:`.model_files`),
validated before anything starts. It imports only the control room."""
