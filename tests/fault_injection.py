"""Fault drills as a worker extension (EngineConfig.worker_extension_cls, vLLM's --worker-extension-cls): the
production Worker carries no injection code; a test deployment built with
`worker_extension_cls="fault_injection.StepFaultExtension"` gets these methods as RPC targets. The spawned worker
processes import this module by name (they inherit the test run's sys.path, which holds tests/)."""
from __future__ import annotations

EXTENSION = "fault_injection.StepFaultExtension"


class _FailingRunner:
    """Stands in for a worker's model runner for one step."""

    def __init__(self, worker: int):
        self.worker = worker

    def execute(self, inputs, hidden_in=None):
        raise RuntimeError(f"fault injected in the forward of worker {self.worker}")


class StepFaultExtension:
    step_fault_armed = False

    def arm_step_fault(self) -> None:
        """Make this worker's next pipelined step fail in its forward (a failure drill: every stage must fail that
        step at once, well inside the collective timeout, and the next step must run)."""
        self.step_fault_armed = True

    def execute_pipeline(self, micro_batches, sampling=None, exchange_cpu_share=None):
        if not self.step_fault_armed:
            return super().execute_pipeline(micro_batches, sampling, exchange_cpu_share)
        self.step_fault_armed = False
        runner = self.instance.runner
        self.instance.runner = _FailingRunner(self.me)
        try:
            return super().execute_pipeline(micro_batches, sampling, exchange_cpu_share)
        finally:
            self.instance.runner = runner
