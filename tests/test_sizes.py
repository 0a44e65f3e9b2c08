import pytest

from autotune.errors import ConfigError
from autotune.sizes import format_size, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512MiB", 512 * 2**20),
        ("24GiB", 24 * 2**30),
        ("16GB", 16 * 10**9),
        ("1.5GiB", int(1.5 * 2**30)),
        ("1024", 1024),
        ("64 kib", 64 * 1024),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12XB", "-1GiB", "0MiB", "ten"])
def test_parse_size_refuses_and_names_the_flag(text):
    with pytest.raises(ConfigError, match="--memory-budget"):
        parse_size(text)


def test_format_size():
    assert format_size(None) == "-"
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**20) == "3.0 MiB"
