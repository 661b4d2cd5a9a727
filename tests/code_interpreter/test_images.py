"""PIL images arrive as results with their PNG, as E2B's kernels give them: an image shown
(`Image.show()`, which would otherwise open a desktop viewer such as `xdg-open`), saved to a
file (the file is written too) or left as the cell's value."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from e2b_code_interpreter import Sandbox

IMAGE = (
    "import numpy\nfrom PIL import Image\n"
    "image = Image.fromarray((numpy.random.rand(16, 16, 3) * 255).astype('uint8'))\n"
)
PNG = b"\x89PNG"


@pytest.mark.parametrize(
    "code",
    ["image.show()\nprint('shown')", "image.save('saved.png')\nprint('saved')", "image"],
    ids=["show", "save", "value"],
)
def test_an_image_is_a_png_result(sandbox: Sandbox, code: str) -> None:
    execution = sandbox.run_code(IMAGE + code)
    assert execution.error is None, execution.error
    [result] = execution.results
    assert result.png is not None and base64.b64decode(result.png).startswith(PNG)


def test_a_saved_image_is_written_too(sandbox: Sandbox, server_cwd: Path) -> None:
    execution = sandbox.run_code(IMAGE + "image.save('written.png', format='PNG')")
    assert execution.error is None, execution.error
    assert (server_cwd / "written.png").read_bytes().startswith(PNG)
    # A file object is no path: nothing is shown.
    to_file = sandbox.run_code(IMAGE + "image.save(open('f.png', 'wb'), format='PNG')")
    assert to_file.error is None and to_file.results == []
