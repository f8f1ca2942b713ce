"""The dtype spellings every dtype argument of the clients accepts, the same
set as tallyctl's --dtype: case-insensitive float32|fp32, float64|fp64,
bfloat16|bf16, float16|fp16, the proto enum names (DTYPE_FLOAT32, ...), and
the enum values (pb.DTYPE_BFLOAT16, 3). None means the model's own dtype
(DTYPE_UNSPECIFIED).

    parse_dtype("BF16")                    # pb.DTYPE_BFLOAT16
    parse_dtype(pb.DTYPE_FLOAT64)          # pb.DTYPE_FLOAT64
    parse_dtype("half", argument="dtype")  # ValueError naming the spellings
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union, cast

from tally_client._proto.tally.v1 import trainer_pb2 as pb

# A dtype argument: a spelling, a pb.DType value, or None (the model's).
DTypeLike = Optional[Union[str, int]]

_SHORT_NAMES: Dict[str, pb.DType] = {
    "float32": pb.DTYPE_FLOAT32, "fp32": pb.DTYPE_FLOAT32,
    "float64": pb.DTYPE_FLOAT64, "fp64": pb.DTYPE_FLOAT64,
    "bfloat16": pb.DTYPE_BFLOAT16, "bf16": pb.DTYPE_BFLOAT16,
    "float16": pb.DTYPE_FLOAT16, "fp16": pb.DTYPE_FLOAT16,
}


def accepted_spellings() -> str:
    """The accepted spellings, as the error message lists them."""
    pairs: Dict[pb.DType, List[str]] = {}
    for name, value in _SHORT_NAMES.items():
        pairs.setdefault(value, []).append(name)
    names = ", ".join("|".join(pair) for pair in pairs.values())
    enums = ", ".join(f"{name} ({value})" for name, value in pb.DType.items())
    return (f"{names} (case-insensitive), or a proto enum name or value: "
            f"{enums}")


def parse_dtype(value: DTypeLike, argument: str = "dtype") -> pb.DType:
    """The pb.DType value of `value`.

    Args:
        value: a spelling (see the module's docstring), a pb.DType value, or
            None for DTYPE_UNSPECIFIED (the model's dtype).
        argument: the argument's name, for the error message.

    Returns:
        The pb.DType enum value.

    Raises:
        ValueError: any other value; the message names `argument` and lists
            the accepted spellings.
    """
    if value is None:
        return pb.DTYPE_UNSPECIFIED
    if isinstance(value, str):
        lower = value.lower()
        if lower in _SHORT_NAMES:
            return _SHORT_NAMES[lower]
        if lower.upper() in pb.DType.keys():
            return cast(pb.DType, pb.DType.Value(lower.upper()))
    elif isinstance(value, int) and not isinstance(value, bool):
        if value in pb.DType.values():
            return cast(pb.DType, value)
    raise ValueError(f"{argument}: unknown dtype {value!r}; accepted: "
                     f"{accepted_spellings()}")
