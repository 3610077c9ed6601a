"""Models that leave mmpt: the formats a run or release is exported to besides an mmpt release.

- `towers`: each method's encoders as modules with plain tensor inputs (what ONNX exports), and their
  input contract;
- `formats`: which format applies to which model, checked before any weight is read;
- `card`: the model card (README.md) written into every release and export folder;
- `to_onnx`, `to_open_clip`, `to_official`: one module per format.

`towers`, `formats` and `card` sit in the releases' layer (`mmpt.release` writes the card); the format
modules sit with the tools. This package file imports nothing, so importing the card from
`mmpt.release` loads none of the tools.
"""
