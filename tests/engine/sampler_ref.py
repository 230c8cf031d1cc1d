"""Shared by the sampler tests: the float64 penalty reference and a one-thread fixture."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The tensors here are tiny: intra-op threads only add sync cost (badly on busy CPUs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def penalized(logits, params, prompt_ids=(), output_ids=()):
    """Reference penalties: CTRL repetition over prompt+output, OpenAI freq/presence on output;
    then OpenAI's logit_bias added."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for t in set(prompt_ids) | set(output_ids):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in Counter(output_ids).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    for t, bias in params.logit_bias:
        x[t] += bias
    return x
