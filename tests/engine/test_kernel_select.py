"""MBUFO_KERNELS: read once, validated, and the only thing that moves a path off its default."""

from __future__ import annotations

import pytest
import torch

from engine import kernel_select
from engine.errors import InvalidRequest
from kernels.triton_util import HAS_TRITON, interpreter_active


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(kernel_select.ENV_VAR, raising=False)
    kernel_select.set_mode(None)
    yield
    kernel_select.set_mode(None)


CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_auto_is_triton_on_gpu_only():
    assert kernel_select.kernel_mode() == "auto"
    assert kernel_select.use_triton(CPU) is False
    assert kernel_select.use_triton(GPU) is HAS_TRITON


def test_torch_forces_references(monkeypatch):
    monkeypatch.setenv(kernel_select.ENV_VAR, "torch")
    kernel_select.set_mode(None)
    assert kernel_select.use_triton(GPU) is False
    assert kernel_select.use_triton(CPU) is False


def test_environment_is_read_once(monkeypatch):
    monkeypatch.setenv(kernel_select.ENV_VAR, "torch")
    assert kernel_select.kernel_mode() == "torch"
    monkeypatch.setenv(kernel_select.ENV_VAR, "auto")
    assert kernel_select.kernel_mode() == "torch"  # cached until set_mode(None)
    kernel_select.set_mode(None)
    assert kernel_select.kernel_mode() == "auto"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv(kernel_select.ENV_VAR, " Triton ")
    assert kernel_select.kernel_mode() == "triton"
    if HAS_TRITON:
        assert kernel_select.use_triton(GPU) is True
    if not interpreter_active():
        with pytest.raises(InvalidRequest, match="TRITON_INTERPRET"):
            kernel_select.use_triton(CPU)


def test_unknown_values_are_refused(monkeypatch):
    monkeypatch.setenv(kernel_select.ENV_VAR, "cuda")
    with pytest.raises(InvalidRequest, match="MBUFO_KERNELS"):
        kernel_select.kernel_mode()
    with pytest.raises(InvalidRequest):
        kernel_select.set_mode("fast")


def test_set_mode_overrides_the_environment(monkeypatch):
    monkeypatch.setenv(kernel_select.ENV_VAR, "auto")
    kernel_select.set_mode("torch")
    assert kernel_select.use_triton(GPU) is False
    kernel_select.set_mode(None)
    assert kernel_select.kernel_mode() == "auto"
