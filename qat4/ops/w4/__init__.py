"""Ops on packed 4-bit weights: the linear layers, the output layer and the embedding lookup.

A weight W [N, K] (N outputs, K inputs, K a multiple of 32) is kept in the layout of
:mod:`qat4.checkpoint.packing`: ``packed`` int32 [N, K/8], column ``8j + i`` in bits ``4i..4i+3`` of
word ``j`` as the code ``level + 8``; ``scales`` fp16/bf16 [N, K/32], ``W[r, c] = scales[r, c // 32]
* level``. Every product computes ``y = x @ W.T`` with fp32 accumulation; only the expanded product
of prompt steps writes W in 16 bits, one matrix at a time into a scratch.

One kernel family per module; each imports only modules listed above it:

- :mod:`~qat4.ops.w4.reference`: the plain-torch references every kernel is checked against;
- :mod:`~qat4.ops.w4.common`: the Triton pieces several kernels share (unpacking, epilogues, the
  argmax reduction);
- :mod:`~qat4.ops.w4.tiling`: the decode GEMV's tiling space, the autotuners' timer, and the
  record of a model's launched and pinned GEMV tilings (``MatvecTilings``);
- :mod:`~qat4.ops.w4.gemv`: the decode GEMV (at most 16 rows of x) with its fused epilogues;
- :mod:`~qat4.ops.w4.logits`: the output layer on the GEMV (softcapped logits, argmax);
- :mod:`~qat4.ops.w4.gemm`: the prefill GEMM;
- :mod:`~qat4.ops.w4.batch_tiling`: the decode-batch product's tiling table and split rule;
- :mod:`~qat4.ops.w4.batch`: the tensor-core decode-batch product (2..128 rows);
- :mod:`~qat4.ops.w4.embedding`: row lookup in a packed table (and whole matrices expanded);
- :mod:`~qat4.ops.w4.expanded`: prompt steps' products, W expanded into a 16-bit scratch, then cuBLAS;
- :mod:`~qat4.ops.w4.dispatch`: the layers the model calls, each picking a kernel by the rows of x.
"""
