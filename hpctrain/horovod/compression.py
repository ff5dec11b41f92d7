"""Gradient compression for the wire, as Horovod's `hvd.Compression`: `none`, and `fp16` (floating tensors
travel as float16 and come back in their own dtype; other dtypes pass unchanged)."""

from __future__ import annotations

from typing import Any


class Compressor:
    """compress(tensor) -> (tensor, context); decompress(tensor, context) -> tensor."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        import torch

        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor.type(ctx) if ctx is not None else tensor


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
