"""llama.cpp GGUF files of architecture `gemma4`: read into qat4's packed form, write an exact Q4_0 file.

One job per module: `container` is the GGUF file format (parse a header, encode one), `names` the
tensor names (canonical <-> llama.cpp), `q4_0` the exact Q4_0 <-> packed transcoding, `metadata` the
config, tokenizer and generation settings as GGUF metadata (both ways), `reader` GGUFSource and
`writer` write_gguf.

Tensor data stays memory-mapped and is transcoded in slices, so neither reading nor writing holds a
second copy of a large table. Byte views assume a little-endian host, as GGUF files themselves are.
"""
