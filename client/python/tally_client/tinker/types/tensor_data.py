"""TensorData: a typed n-D tensor in row-major order, as Tinker's
`tinker.types.tensor_data.TensorData` takes and returns it. numpy and torch
are imported only by the conversions that return them.

    TensorData(data=[[1, 2], [3, 4]], dtype="int64").shape      # [2, 2]
    TensorData.from_numpy(numpy.zeros((2, 3), numpy.float32)).tolist()
    TensorData(data=[5.0, 6.0], dtype="int64").data             # [5, 6]
"""

from __future__ import annotations

import array
import dataclasses
import math
from typing import Any, List, Optional, Sequence, Tuple

from tally_client.tinker.types.tensor_dtype import TensorDtype

# array.array typecodes that store (and round) a TensorData dtype.
_TYPECODES = {"int64": "q", "float32": "f"}


@dataclasses.dataclass(init=False)
class TensorData:
    """A typed tensor: `data` its values flattened in row-major order
    (None: empty),
    `dtype` "int64" or "float32" (values are stored rounded to it; an int64
    takes floats only where they are integral), `shape` None for 1-D. The
    constructor also takes nested lists, numpy arrays and torch tensors as
    `data`, and infers `shape` from them when it is None."""

    data: List[Any]
    dtype: TensorDtype
    shape: Optional[List[int]]

    def __init__(self, data: Any = None, dtype: Optional[TensorDtype] = None,
                 shape: Optional[Sequence[int]] = None) -> None:
        if dtype is None:
            raise TypeError("TensorData requires `dtype`")
        if dtype not in _TYPECODES:
            raise ValueError(f"TensorData dtype must be one of "
                             f"{sorted(_TYPECODES)}, not {dtype!r}")
        values, inferred = _flatten([] if data is None else data)
        self.data = _stored(values, dtype)
        self.dtype = dtype
        self.shape = None if shape is None else [int(size) for size in shape]
        if self.shape is None and len(inferred) > 1:
            self.shape = inferred
        if self.shape is not None and \
                math.prod(self.shape) != len(self.data):
            raise ValueError(f"TensorData has {len(self.data)} values for "
                             f"shape {self.shape}")

    @classmethod
    def from_numpy(cls, array_like: Any) -> "TensorData":
        """From a numpy array: float kinds become float32, signed integer
        kinds int64."""
        kind = array_like.dtype.kind
        if kind not in "fi":
            raise ValueError(f"TensorData holds floats or signed integers, "
                             f"not {array_like.dtype}")
        return cls(data=array_like.flatten().tolist(),
                   dtype="float32" if kind == "f" else "int64",
                   shape=list(array_like.shape))

    @classmethod
    def from_torch(cls, tensor: Any) -> "TensorData":
        """From a torch tensor: floating dtypes become float32, the others
        int64."""
        return cls(data=tensor.detach().cpu().flatten().tolist(),
                   dtype="float32" if tensor.dtype.is_floating_point
                   else "int64",
                   shape=list(tensor.shape))

    def to_numpy(self) -> Any:
        """A numpy array of this dtype and shape."""
        import numpy  # pylint: disable=import-outside-toplevel
        values = numpy.array(self.data, dtype=self.dtype)
        return values if self.shape is None else values.reshape(self.shape)

    def to_torch(self) -> Any:
        """A torch tensor of this dtype and shape."""
        import torch  # pylint: disable=import-outside-toplevel
        values = torch.tensor(self.data, dtype=getattr(torch, self.dtype))
        return values if self.shape is None else values.reshape(self.shape)

    def tolist(self) -> List[Any]:
        """The values as (nested, by shape) Python lists."""
        return _nest(self.data, self.shape or [len(self.data)])


def _flatten(data: Any) -> Tuple[List[Any], List[int]]:
    """(values in row-major order, shape) of a flat or nested sequence, a
    numpy array or a torch tensor; ValueError for a ragged one."""
    if hasattr(data, "tolist") and not isinstance(data, (list, tuple)):
        data = data.tolist()  # a numpy array or a torch tensor
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"TensorData data must be a list, a numpy array or "
                         f"a torch tensor, not {type(data).__name__}")
    if not any(isinstance(item, (list, tuple)) for item in data):
        return list(data), [len(data)]
    parts = [_flatten(item) for item in data]
    inner = parts[0][1]
    if any(shape != inner for _, shape in parts) or any(
            not isinstance(item, (list, tuple)) for item in data):
        raise ValueError("TensorData data must be rectangular; ragged nested "
                         "lists are not supported")
    return [value for values, _ in parts for value in values], \
        [len(data)] + inner


def _stored(values: List[Any], dtype: str) -> List[Any]:
    """`values` as stored in `dtype`: float32 rounded, int64 exact (a float
    only where integral, as a token id sent as 5.0)."""
    if dtype == "int64":
        for value in values:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"TensorData of dtype int64: {value!r} is "
                                 f"not an integer")
        values = [int(value) if isinstance(value, float) else value
                  for value in values]
    try:
        return array.array(_TYPECODES[dtype], values).tolist()
    except (TypeError, OverflowError) as error:
        raise ValueError(f"TensorData of dtype {dtype}: {error}") from error


def _nest(values: List[Any], shape: List[int]) -> List[Any]:
    if len(shape) <= 1:
        return list(values)
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step:(i + 1) * step], shape[1:])
            for i in range(shape[0])]
