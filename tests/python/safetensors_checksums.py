"""Prints checksums of every tensor in a safetensors file, read with numpy only.

An independent reader (struct + json + numpy.frombuffer, no safetensors
package) that checkpoint_test.cc runs against a file tally wrote. One line per
tensor, tab separated:

    name  dtype  shape (comma separated)  sum  position-weighted sum

where the position-weighted sum is sum(x[i] * (i + 1)) over the flattened
tensor, so a permutation of the elements changes it. A first line
"__metadata__<TAB><json>" carries the header's metadata.

Usage: /usr/bin/python3 safetensors_checksums.py FILE
"""

import json
import struct
import sys

import numpy as np

NUMPY_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
}


def decode(dtype, raw):
    if dtype == "BF16":
        # bfloat16 is the upper half of a float32.
        halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
        return (halves << 16).view(np.float32)
    return np.frombuffer(raw, dtype=NUMPY_DTYPES[dtype])


def main(path):
    with open(path, "rb") as f:
        data = f.read()
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_size])
    buffer = data[8 + header_size:]
    print("__metadata__\t" +
          json.dumps(header.pop("__metadata__", {}), sort_keys=True))
    for name, info in header.items():
        begin, end = info["data_offsets"]
        values = decode(info["dtype"], buffer[begin:end]).reshape(info["shape"])
        flat = values.astype(np.float64).ravel()
        positions = np.arange(1, flat.size + 1, dtype=np.float64)
        print("\t".join([
            name,
            info["dtype"],
            ",".join(str(d) for d in values.shape),
            repr(float(flat.sum())),
            repr(float((flat * positions).sum())),
        ]))


if __name__ == "__main__":
    main(sys.argv[1])
