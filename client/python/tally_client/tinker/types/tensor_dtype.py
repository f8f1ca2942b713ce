"""TensorDtype: the element types of a TensorData (Tinker's
`tinker.types.tensor_dtype`).

    dtype: TensorDtype = "float32"
"""

from typing import Literal

TensorDtype = Literal["int64", "float32"]
