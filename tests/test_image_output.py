"""Sample grids are written in the format their file extension names (``flowrl sample --out x.jpg`` writes a
JPEG), every pixel kept by the lossless formats, and an extension that names no format is refused in one
sentence with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.errors import FlowRLError
from flowrl.visualize import IMAGE_FORMATS, grid_array, image_format, save_grid

# the first bytes of each format's files, and PIL's name for the format it detects when reading
MAGIC = {
    "PNG": (b"\x89PNG\r\n\x1a\n",),
    "JPEG": (b"\xff\xd8\xff",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "BMP": (b"BM",),
    "TIFF": (b"II*\x00", b"MM\x00*"),
}
SUPPORTED = ".png, .jpg, .jpeg, .webp, .gif, .bmp, .tif or .tiff"


def colour_samples() -> torch.Tensor:
    return torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def gray_samples() -> torch.Tensor:
    return torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(1))


def has_magic(data: bytes, fmt: str) -> bool:
    if fmt == "WEBP":
        return data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    return any(data.startswith(m) for m in MAGIC[fmt])


@pytest.mark.parametrize("suffix", [*IMAGE_FORMATS, ".JPG", ".Png"])
def test_each_extension_writes_the_format_it_names(tmp_path, suffix):
    fmt = IMAGE_FORMATS[suffix.lower()]
    path = tmp_path / f"grid{suffix}"
    save_grid(colour_samples(), path, ncol=3)
    data = path.read_bytes()
    assert has_magic(data, fmt), data[:16]
    for other in {*IMAGE_FORMATS.values()} - {fmt}:
        assert not has_magic(data, other)
    with Image.open(path) as image:
        assert image.format == fmt
        assert image.size == (3 * (8 * 6 + 2) + 2, 2 * (8 * 6 + 2) + 2)  # 3 columns, 2 rows of 8x8 x 6, 2-pixel gaps
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize("suffix", [".png", ".webp", ".bmp", ".tif", ".tiff"])
def test_lossless_formats_keep_every_pixel(tmp_path, suffix):
    samples = colour_samples()
    path = tmp_path / f"grid{suffix}"
    save_grid(samples, path, ncol=3)
    with Image.open(path) as image:
        assert image.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(image), grid_array(samples, 3, scale=6, pad=2))


def test_gif_keeps_every_pixel_of_a_grayscale_grid_and_jpeg_is_close(tmp_path):
    gray = gray_samples()
    save_grid(gray, tmp_path / "grid.gif", ncol=3)
    with Image.open(tmp_path / "grid.gif") as image:
        assert image.format == "GIF"
        np.testing.assert_array_equal(np.asarray(image.convert("RGB")), grid_array(gray, 3, scale=6, pad=2))
    colour = colour_samples()
    save_grid(colour, tmp_path / "grid.jpg", ncol=3)
    with Image.open(tmp_path / "grid.jpg") as image:
        error = np.abs(np.asarray(image.convert("RGB")).astype(int) - grid_array(colour, 3, scale=6, pad=2).astype(int))
    assert 0 < error.mean() < 3.0, error.mean()  # lossy (quality 95): about 2 of 255 on random colour pixels


def test_videos_are_written_as_a_filmstrip_in_the_named_format(tmp_path):
    videos = torch.rand(2, 3, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    save_grid(videos, tmp_path / "strip.webp", ncol=2)
    frames = videos.permute(0, 2, 1, 3, 4).reshape(8, 3, 8, 8)
    with Image.open(tmp_path / "strip.webp") as image:
        assert image.format == "WEBP"
        np.testing.assert_array_equal(np.asarray(image.convert("RGB")), grid_array(frames, 4, scale=6, pad=2))


@pytest.mark.parametrize("name", ["grid.svg", "grid.pdf", "grid", "grid.png.bak"])
def test_an_extension_naming_no_image_format_is_one_sentence_and_writes_nothing(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(FlowRLError) as info:
        save_grid(colour_samples(), path, ncol=3)
    assert str(info.value) == f"cannot tell an image format from the extension of '{path}'; use {SUPPORTED}."
    assert list(tmp_path.iterdir()) == []


def test_image_format_names_the_formats_and_the_callers_own_extensions():
    assert {s: image_format(f"a/b{s}") for s in IMAGE_FORMATS} == {
        ".png": "PNG",
        ".jpg": "JPEG",
        ".jpeg": "JPEG",
        ".webp": "WEBP",
        ".gif": "GIF",
        ".bmp": "BMP",
        ".tif": "TIFF",
        ".tiff": "TIFF",
    }
    assert image_format("OUT.JPEG") == "JPEG"
    with pytest.raises(FlowRLError) as info:
        image_format("samples.txt", also=(".npy",))
    assert str(info.value) == (
        "cannot tell an image format from the extension of 'samples.txt'; use .png, .jpg, .jpeg, .webp, .gif, .bmp, .tif, .tiff or .npy."
    )
