"""Ready-made simulated workloads: the paper's Table III mix and a many-app node for speed tests."""

from __future__ import annotations

from gpuprims.sched.dag import App, dnn_recog, single
from gpuprims.sched.sim import Arrival, Workload

#: Share of DNN-Recog's router output per label (the paper does not give one; an assumption).
RECOG_ROUTES = {"router": {"person": 0.5, "vehicle": 0.4}}

#: Requests per 30 ms round per app at load 1.0: what the paper's Table III reports the spatio-temporal
#: scheduler serving (DNN-Recog batch 8, Yolo batch 2, ResNext batch 1 per round).
TABLE3_PER_ROUND = {"dnn_recog": 8, "yolo": 2, "resnext": 1}


def paper_table3(*, load: float = 1.0, kind: str = "constant", deadline_ms: float = 30.0,
                 round_ms: float = 30.0) -> list[Workload]:
    """The Table III mix (DNN-Recog, a YOLO-class model at 60%, ResNeXt-50 at 50%; paper Fig. 10).

    ``kind="constant"`` delivers each app's requests as one burst per round (camera frames in step
    with the rounds, as in the paper's 30 fps setting); ``"poisson"`` at the same mean rate.
    ``load`` scales every rate. Raises ValueError for a non-positive load or an unknown kind.
    """
    if not load > 0:
        raise ValueError(f"load must be > 0, got {load}")
    if kind not in ("constant", "poisson"):
        raise ValueError(f"kind must be 'constant' or 'poisson', got {kind!r}")
    apps = [dnn_recog(deadline_ms=deadline_ms), single("yolo", "yolov3", 60, deadline_ms),
            single("resnext", "resnext50", 50, deadline_ms)]
    out = []
    for a in apps:
        per_round = TABLE3_PER_ROUND[a.name] * load
        rate = per_round * 1000.0 / round_ms
        if kind == "constant":
            burst = max(1, round(per_round))
            arr = Arrival("constant", burst * 1000.0 / round_ms * (per_round / burst), burst=burst)
        else:
            arr = Arrival("poisson", rate)
        out.append(Workload(a, arr, RECOG_ROUTES if a.name == "dnn_recog" else {}))
    return out


def many_apps(*, num_gpus: int, num_apps: int, rate_rps: float, deadline_ms: float = 50.0) -> list[Workload]:
    """``num_apps`` Poisson apps cycling through the paper's models, a DNN-Recog every eighth app.

    Each single-model app runs at its model's paper GPU% (Fig. 1c/10 style shares); apps are spread
    over ``num_gpus`` by the scheduler's placement.
    """
    if num_gpus < 1 or num_apps < 1 or not rate_rps > 0:
        raise ValueError(f"need num_gpus >= 1, num_apps >= 1, rate_rps > 0; got {num_gpus}, {num_apps}, {rate_rps}")
    models = [("alexnet", 15), ("mobilenet", 15), ("resnet50", 30), ("vgg19", 40), ("resnext50", 50),
              ("yolov3", 60), ("resnet50", 30)]
    out: list[Workload] = []
    for i in range(num_apps):
        if i % 8 == 7:
            app: App = dnn_recog(f"recog{i}", deadline_ms)
            out.append(Workload(app, Arrival("poisson", rate_rps), RECOG_ROUTES))
        else:
            m, pct = models[i % len(models)]
            out.append(Workload(single(f"app{i}", m, pct, deadline_ms), Arrival("poisson", rate_rps)))
    return out
