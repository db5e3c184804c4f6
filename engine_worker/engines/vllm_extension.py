"""Methods redroll adds to vLLM's model workers (vLLM's ``worker_extension_cls`` extension point).

vLLM imports this class inside each of its model-worker processes and mixes it into the worker;
``AsyncLLM.collective_rpc("redroll_load_weights", kwargs={"path": ...})`` then runs the method in
every one of them. Tensors do not travel as ``collective_rpc`` arguments (on the CPU build such
arguments arrive broken and leave the model's layers on the meta device, which kills the engine):
the worker process stages a push in one safetensors file in shared memory and passes its path.
Kept free of redroll imports: it runs inside vLLM's processes.
"""

from __future__ import annotations

EXTENSION_CLASS = "redroll.engine_worker.engines.vllm_extension.RedrollWorkerExtension"


class RedrollWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: ``reload_weights`` is its own)."""

    def redroll_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file at ``path`` (checkpoint names and format) into
        the model in place; returns how many were loaded."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(tensors)

    def redroll_ping(self) -> str:
        """Tells the adapter that this extension is installed in the workers."""
        return "redroll"
