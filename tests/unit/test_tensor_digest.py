"""The weight checker's per-tensor digest (devserver/tensor_digest.py): sha256's first 8 bytes on the CPU,
as SGLang 0.5.23's tensor_hash; the on-device hash, run here on CPU tensors, equal for equal bytes and
changed by a changed element or by two elements swapped."""

from __future__ import annotations

import hashlib

import torch

from specops.devserver import tensor_digest


def test_a_cpu_tensor_gets_the_first_8_bytes_of_its_sha256():
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expected = hashlib.sha256(weights.numpy().tobytes()).digest()[:8].hex()
    assert tensor_digest.digest(weights) == expected


def test_the_device_hash_tells_equal_bytes_from_a_changed_or_moved_element(monkeypatch):
    monkeypatch.setattr(tensor_digest, "CHUNK_ELEMENTS", 64)  # several chunks, folded in order
    weights = torch.randn(1001, dtype=torch.bfloat16)  # an odd number of 2-byte elements: hashed by bytes
    changed, swapped = weights.clone(), weights.clone()
    changed[500] += 1
    swapped[[0, 700]] = swapped[[700, 0]]
    digest = tensor_digest.device_hash(weights)
    assert digest == tensor_digest.device_hash(weights.clone())
    assert digest != tensor_digest.device_hash(changed)
    assert digest != tensor_digest.device_hash(swapped)
    words = torch.randn(1000, dtype=torch.bfloat16)  # 2,000 bytes: hashed by 4-byte words
    assert tensor_digest.device_hash(words) != tensor_digest.device_hash(words.flip(0))
    assert 0 <= digest < 2**64
