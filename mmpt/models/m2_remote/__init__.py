"""The M²-Encoder as files transformers loads with `trust_remote_code=True`: the network, its configuration,
a `PreTrainedModel` around it and the GLM tokenizer. They import only torch, transformers, sentencepiece and
each other, so `--format transformers` copies them into the exported folder as they are, and mmpt trains
the same network code that folder runs."""
