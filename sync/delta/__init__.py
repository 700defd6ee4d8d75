"""Delta compression of weight versions: the public `delta` API and the codec behind it.

The API (`encode`, `decode`, `apply_inplace`, `DeltaError`, ...) is defined in
`sync.delta.api` and re-exported here:

    from sync import delta
    blob = delta.encode(base, new)        # base/new: dict name -> np.ndarray
    rebuilt = delta.decode(base, blob)    # bit-identical to `new`, or raises delta.DeltaError

Modules, each importing only those listed after it: `api` (the blob layout, encode / decode /
apply in place, the checks), `buffers` (recycled output memory for `decode`), `parallel` (the
thread-pool helpers), `codec` (one chunk: choosing its form, encoding, applying),
`unit_kernels` (the SPARSE_UNIT and DENSE_UNIT kernels), `sparse_kernels` (the SPARSE kernel),
`jit` (numba loading and the on-disk cache of the compiled kernels), and `chunk_format` (the
payload layouts, zig-zag, byte planes, gaps and the changes hash, which the codec and both
kernel modules share).
"""

from sync.delta.api import apply_inplace
from sync.delta.api import CHECKS
from sync.delta.api import decode
from sync.delta.api import decode_stream
from sync.delta.api import DeltaError
from sync.delta.api import encode
from sync.delta.api import encode_to
from sync.delta.api import END_MAGIC
from sync.delta.api import FORMAT
from sync.delta.api import MAGIC
from sync.delta.api import read_header
from sync.delta.api import read_trailer
from sync.delta.api import release_buffers
from sync.delta.api import Stats
from sync.delta.api import warm_up

__all__ = ["CHECKS", "DeltaError", "END_MAGIC", "FORMAT", "MAGIC", "Stats", "apply_inplace",
           "decode", "decode_stream", "encode", "encode_to", "read_header", "read_trailer",
           "release_buffers", "warm_up"]
