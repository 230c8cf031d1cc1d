"""GGUF model files: a bounded pre-scan (guard), then gguf.GGUFReader over a mapping."""

from __future__ import annotations

from engine.gguf.guard import ScanResult, scan_buffer, scan_file
from engine.gguf.model_file import ModelFile, TensorInfo

__all__ = ["ModelFile", "ScanResult", "TensorInfo", "scan_buffer", "scan_file"]
