"""Test helper: a stand-in for CUDA graph capture that runs the graph path on the CPU."""

from __future__ import annotations


class FakeCapture:
    """Runs `fn` as CudaGraphCapturer does (warm-ups, then the captured run); replay runs
    it again into the same output tensor."""

    def __init__(self, on_warmed=None) -> None:
        self.captures = 0
        self.on_warmed = on_warmed

    def __call__(self, fn):
        self.captures += 1
        fn()
        if self.on_warmed is not None:
            self.on_warmed()
        out = fn()
        return (lambda: out.copy_(fn())), out
