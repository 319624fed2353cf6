"""The captured layers' outputs: hooks that stop the forward after the last one; padded batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specops.extract.target import Record
from specops.stage import StageError


class _StopForward(Exception):
    """Raised by the hook of the last captured layer: nothing after it needs to run."""


def decoder_body(model: Any) -> tuple[Any, Any]:
    """(the module whose forward runs the decoder layers, its ModuleList of layers)."""
    import torch

    inner = getattr(model, "model", None)
    for body in (getattr(inner, "language_model", None), inner, model):
        if body is not None and isinstance(getattr(body, "layers", None), torch.nn.ModuleList):
            return body, body.layers
    raise StageError(f"cannot find the decoder layers of {type(model).__name__}: not a decoder-only model")


# Layer types for which "no mask" is exactly what transformers builds for a batch without padding: causal
# attention (sdpa's is_causal) and linear attention without a padding mask. Sliding windows need theirs.
_MASK_FREE_LAYER_TYPES = frozenset({"full_attention", "linear_attention"})


def unpadded_mask_mapping(body: Any) -> dict[str, None] | None:
    """The per-layer-type masks of an unpadded batch, {type: None}, when the body accepts such a mapping.

    Given a 2D mask or none, transformers builds the masks itself and, looking for packed sequences in
    the position ids, reads a device value back (`.all()` in masking_utils): the host then waits for the
    device at every forward, and the device for the host while the next kernels are launched. For an
    unpadded batch those masks are all None anyway; handing them over skips the read-back.
    """
    import inspect

    layer_types = getattr(body.config, "layer_types", None)
    if not layer_types or not set(layer_types) <= _MASK_FREE_LAYER_TYPES:
        return None
    try:
        source = inspect.getsource(type(body).forward)
    except (OSError, TypeError):
        return None
    if "isinstance(causal_mask_mapping := attention_mask, dict)" not in source:
        return None
    return {layer_type: None for layer_type in sorted(set(layer_types))}


class LayerCapture:
    """Forward hooks on the captured layers; returns their outputs in layer_ids order.

    `skip_mask_creation` hands unpadded batches their (empty) masks directly where the model allows it
    (`unpadded_mask_mapping`); the states are the same either way.
    """

    def __init__(self, model: Any, layer_ids: Sequence[int], skip_mask_creation: bool = True):
        self.body, layers = decoder_body(model)
        if max(layer_ids) >= len(layers):
            raise StageError(
                f"target layer {max(layer_ids)} out of range: the model has {len(layers)} "
                f"layers "
                f"(0-{len(layers) - 1})"
            )
        self.layer_ids = list(layer_ids)
        self.last = max(layer_ids)
        # The residual stream, hence every captured state, has the embeddings' dtype.
        self.dtype = self.body.get_input_embeddings().weight.dtype
        self.hidden_size = int(self.body.config.hidden_size)
        self._outputs: dict[int, Any] = {}
        self._no_padding_masks = unpadded_mask_mapping(self.body) if skip_mask_creation else None
        self._handles = [layers[k].register_forward_hook(self._hook(k)) for k in sorted(set(layer_ids))]

    def _hook(self, k: int) -> Callable:
        def hook(module, args, output):
            self._outputs[k] = output[0] if isinstance(output, tuple) else output
            if k == self.last:
                raise _StopForward

        return hook

    def __call__(self, input_ids: Any, attention_mask: Any = None) -> list[Any]:
        import torch

        self._outputs = {}
        if attention_mask is None and self._no_padding_masks is not None:
            attention_mask = dict(self._no_padding_masks)
        try:
            with torch.inference_mode():
                self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        outputs, self._outputs = self._outputs, {}
        return [outputs[k] for k in self.layer_ids]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> LayerCapture:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pad_batch(batch: Sequence[Record]) -> tuple[Any, Any]:
    """Right-padded int64 ids [B, T] and a mask, or None for the mask when every record is as long."""
    import torch

    width = max(r.num_tokens for r in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, record in enumerate(batch):
        ids[row, : record.num_tokens] = torch.from_numpy(record.input_ids)
        mask[row, : record.num_tokens] = 1
    return ids, (None if bool(mask.all()) else mask)
