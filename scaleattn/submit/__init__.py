"""``scaleattn submit``: send a fit to a Kubernetes cluster as a DaskJob of the dask-kubernetes operator.

The DaskJob (``kubernetes.dask.org/v1``) carries the whole Dask cluster: the operator starts the scheduler and
the worker group, runs one runner pod executing ``scaleattn fit DATASET --out OUT --scheduler
$DASK_SCHEDULER_ADDRESS ...`` and deletes the cluster when the runner pod ends (success or failure). Datasets
and results live in object storage (``s3://``); the S3 credentials and endpoint come from a Secret through
``envFrom`` and never appear in the manifest.

* :mod:`.manifest`: ``render_daskjob``, the single source of truth for the manifest (pure: no cluster, no kr8s);
  ``deploy/kubernetes`` renders the same object, which ``tests/test_deploy.py`` checks.
* :mod:`.follow`: ``apply_daskjob`` and ``runner_exit_code`` talk to the cluster through kr8s (the ``k8s``
  extra), imported lazily.
* :mod:`.command`: the ``scaleattn submit`` options and ``run``.
"""
from .command import add_arguments, main, run
from .follow import FINAL_STATES, SubmitError, apply_daskjob, runner_exit_code
from .manifest import (
                       API_VERSION,
                       DEFAULT_NAME,
                       DEFAULT_NAMESPACE,
                       DEFAULT_SECRET,
                       EXAMPLE_REGISTRY,
                       GPU_FEATURE_DISCOVERY_SELECTOR,
                       GPU_TOLERATIONS,
                       IMAGE_NAME,
                       REGISTRY_ENV,
                       RUN_AS_USER,
                       SCHEDULER_TIMEOUT,
                       WORKER_TIMEOUT,
                       default_image,
                       registry_of,
                       render_daskjob,
                       to_yaml,
)

__all__ = [
    "SubmitError", "render_daskjob", "to_yaml", "apply_daskjob", "runner_exit_code", "add_arguments", "run", "main",
    "default_image", "registry_of", "API_VERSION", "DEFAULT_NAME", "DEFAULT_NAMESPACE", "DEFAULT_SECRET",
    "EXAMPLE_REGISTRY", "GPU_FEATURE_DISCOVERY_SELECTOR", "GPU_TOLERATIONS", "IMAGE_NAME", "REGISTRY_ENV",
    "RUN_AS_USER", "SCHEDULER_TIMEOUT", "WORKER_TIMEOUT", "FINAL_STATES",
]
