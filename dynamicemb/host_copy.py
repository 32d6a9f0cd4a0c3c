"""HostCopy: a small tensor's copy on the host that does not stop the caller.
From CUDA it is copied into pinned memory behind the stream's work, an event
marking when it has landed; from the CPU at once. The training step reads
counts this way (sizes for growth checks, failures to report) without a
host synchronisation."""
import torch


class HostCopy:
    def __init__(self, t: torch.Tensor):
        cuda = t.device.type == "cuda"
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        self.host.copy_(t, non_blocking=cuda)
        self.event = torch.cuda.Event() if cuda else None
        if cuda:  # behind the copy: on t's device's stream, which need not be the current device's
            self.event.record(torch.cuda.current_stream(t.device))

    def landed(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        """The copy, once it has landed."""
        if self.event is not None:
            self.event.synchronize()
        return self.host

    def __deepcopy__(self, memo):  # a CUDA event does not copy: the landed values do
        return HostCopy(self.wait())
