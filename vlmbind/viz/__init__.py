"""Plotly figures and file export shared by results, the CLI and notebooks.

Builders return ``plotly.graph_objects.Figure`` objects from plain tables and arrays; writers are atomic (temporary
file in the target directory, then ``os.replace``) and produce HTML that is readable offline (plotly.js once per
results folder, beside the pages).
"""

from .figures import (
    PLOTLYJS_FILE,
    attention_overlay,
    frame_to_html_table,
    head_heatmap,
    image_data_uri,
    plotlyjs_src,
    shared_plotlyjs,
    write_bytes_atomic,
    write_html_atomic,
    write_text_atomic,
)

__all__ = [
    "PLOTLYJS_FILE",
    "attention_overlay",
    "frame_to_html_table",
    "head_heatmap",
    "image_data_uri",
    "plotlyjs_src",
    "shared_plotlyjs",
    "write_bytes_atomic",
    "write_html_atomic",
    "write_text_atomic",
]
