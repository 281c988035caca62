"""config.json's ``quantization_config`` read once for every reader (float8 pairing,
MXFP4, MaxText's scale check): what it declares, where, and each field of the wrong
kind named with the file and the field, never read as absent."""

import pytest

from meshinit._checkpoint.encodings.config import Declared, declared

WHERE = "ckpt/config.json"


def test_the_first_stated_config_is_the_declared_one_top_level_first():
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    found, problems = declared({"quantization_config": fp8, "text_config": {"x": 1}}, WHERE)
    assert problems == [] and found == Declared(WHERE, "quantization_config", fp8)
    assert (found.method, found.block) == ("fp8", (128, 64))
    assert found.shown == '{"quant_method": "fp8", "weight_block_size": [128, 64]}'
    # empty or null at the top level: a nested config's, named by its field
    nested = {"quantization_config": {}, "text_config": {"quantization_config": fp8}}
    found, problems = declared(nested, WHERE)
    assert problems == [] and found.field == "text_config.quantization_config"
    found, _ = declared({"quantization_config": None, "vision_config": {"quant": 1}}, WHERE)
    assert found == Declared(WHERE) and found.method is found.block is found.shown is None


@pytest.mark.parametrize(
    "size, block",
    [
        (64, (64, 64)),
        ([64], (64, 64)),
        ([128, 64], (128, 64)),
        ((32, 16), (32, 16)),
        (None, None),
        ([64.0, 64.0], (64, 64)),  # whole numbers as some JSON writers write them
        (128.0, (128, 128)),
    ],
)
def test_a_block_size_of_one_number_is_square(size, block):
    found, problems = declared({"quantization_config": {"weight_block_size": size}}, WHERE)
    assert problems == [] and found.block == block


@pytest.mark.parametrize(
    "config, said",
    [
        ({"quantization_config": "fp8"}, 'quantization_config holds the JSON string "fp8", not'),
        ({"quantization_config": 1}, "quantization_config holds the JSON number 1, not an obj"),
        (
            {"text_config": {"quantization_config": [1, 2]}},
            "text_config.quantization_config holds the JSON array [1, 2], not an object",
        ),
        (
            {"quantization_config": {"quant_method": None, "weight_block_size": []}},
            "quantization_config.weight_block_size holds the JSON array [], not a block size",
        ),
        (
            {"quantization_config": {"weight_block_size": [128, -1]}},
            "quantization_config.weight_block_size holds the JSON array [128, -1], not a block",
        ),
        (
            {"quantization_config": {"weight_block_size": 128.5}},
            "quantization_config.weight_block_size holds the JSON number 128.5, not a block "
            "size (128.5 is not a whole number): write it as a list of two positive integers",
        ),
        (
            {"quantization_config": {"weight_block_size": "64"}},
            'quantization_config.weight_block_size holds the JSON string "64", not a block '
            "size (a string): write it as a list of two positive integers",
        ),
        (
            {"quantization_config": {"weight_block_size": ["64", 64]}},
            'quantization_config.weight_block_size holds the JSON array ["64", 64], not a '
            'block size ("64" is a JSON string, not a number)',
        ),
        (
            {"quantization_config": {"weight_block_size": [64, 64, 64]}},
            "quantization_config.weight_block_size holds the JSON array [64, 64, 64], not a "
            "block size (3 numbers, where a block has one or two)",
        ),
        (
            {"quantization_config": {"weight_block_size": [0, 64.0]}},
            "quantization_config.weight_block_size holds the JSON array [0, 64.0], not a "
            "block size (0 is not positive)",
        ),
        (
            {"quantization_config": {"weight_block_size": [True, 64]}},
            "quantization_config.weight_block_size holds the JSON array [true, 64], not a "
            "block size (true is a JSON boolean, not a number)",
        ),
        (
            {"quantization_config": {"quant_method": False}},
            "quantization_config.quant_method holds the JSON boolean false, not a string",
        ),
        (
            {"quantization_config": "x" * 200},
            'quantization_config holds the JSON string "' + "x" * 76 + "..., not an object",
        ),
    ],
)
def test_a_field_of_the_wrong_kind_is_a_problem_naming_the_file_and_the_field(config, said):
    found, problems = declared(config, WHERE)
    assert len(problems) == 1 and problems[0].path == WHERE, problems
    assert problems[0].message.startswith(said), problems[0].message
    assert found.block is None  # never a block size past it


def test_every_wrong_field_is_named_and_a_config_that_is_none_declares_nothing():
    config = {
        "quantization_config": {"quant_method": 8, "weight_block_size": "128"},
        "text_config": {"quantization_config": "fp8"},
    }
    _, problems = declared(config, WHERE)
    assert [p.message.split(" holds")[0] for p in problems] == [
        "quantization_config.quant_method",
        "quantization_config.weight_block_size",
        "text_config.quantization_config",
    ]
    assert declared(None, "") == (Declared(), [])


def test_two_configs_that_state_different_block_sizes_are_a_problem_never_a_pick():
    nested = {"quantization_config": {"weight_block_size": [64, 64]}}
    top = {"quantization_config": {"quant_method": "fp8"}, "text_config": nested}
    found, problems = declared(top, WHERE)
    assert [p.message for p in problems] == [
        "quantization_config.weight_block_size is absent and "
        "text_config.quantization_config.weight_block_size [64, 64]: meshinit reads the "
        "first, and never picks a block size between two; state one weight_block_size, "
        "the same in both, or remove one"
    ]
    assert [p.path for p in problems] == [WHERE] and found.block is None
    # the same block, however written: no problem
    top = {"quantization_config": {"weight_block_size": 64}, "text_config": nested}
    assert declared(top, WHERE)[1] == []
