"""Models that leave mmpt: the model card of every release and export folder, and the formats a run or
release is exported to besides an mmpt release.

- `towers`: a model's encoders as modules with plain tensor inputs (what ONNX exports), as its method
  declares them (`Method.tower_names`, `Method.export_towers`);
- `formats`: which format applies to which model (`Method.export_formats`), checked before any weight is read;
- `card`: the model card (README.md) written into every release (by `mmpt.release`) and export folder;
- `to_onnx`, `to_open_clip`, `to_official`: one module per format.

Nothing here names a method: what differs between methods (towers, architecture and intended use on
the card, open_clip conversion) is the method's (`mmpt/methods/base.py`). The package sits below
`mmpt.release`, which writes its card, and reads loaded models through `formats.LoadedModel`. This
package file imports nothing, so importing the card loads none of the format modules.
"""
