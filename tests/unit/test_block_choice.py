"""How wide the graph's quantization blocks are (``workers.tuning.block_choice``): for int8 the
widest whose measured perplexity keeps the 2% rule, blocks of 32 where none does; for 4-bit
weights the widest within 2 points of blocks of 32's, and only widths the quantizer can store
(``workers.decoders.ort.graph.packable_4bit``)."""

import json

from pathlib import Path

import pytest

from workers.decoders.ort.graph import packable_4bit
from workers.tuning import block_choice
from workers.tuning.perplexity import Rise


def choose(rises: dict[int, float | Exception], how=block_choice.choose, **kwargs):
    """``how`` (``choose``) over fake graphs whose measured rise (in percent) is ``rises[block]``."""
    built: list[int] = []

    def build(block: int) -> Path:
        built.append(block)
        return Path(f"graph-{block}")

    def measure(block: int, graph: Path) -> Rise:
        assert graph == Path(f"graph-{block}")
        rise = rises[block]
        if isinstance(rise, Exception):
            raise rise
        return Rise(reference=10.0, graph=10.0 * (1 + rise / 100), tokens=2044)

    return how(build, measure, **kwargs), built


def test_the_widest_blocks_within_the_rule_serve_and_narrower_ones_are_not_built():
    choice, built = choose({128: 1.5, 64: 0.6})
    assert (choice.block, choice.graph, built) == (128, Path("graph-128"), [128])
    assert round(choice.rise.percent, 6) == 1.5 and choice.refused == ()
    assert choice.summary().startswith("blocks of 128, perplexity 10.15 against 10.00 in float32 (+1.5%")


def test_blocks_that_cost_more_than_the_rule_give_way_to_narrower_ones_and_say_why():
    choice, built = choose({128: 2.5, 64: 0.7})
    assert (choice.block, built) == (64, [128, 64])
    assert choice.refused == ((128, "perplexity +2.5% over float32, past +2.0%"),)
    assert "blocks of 128 refused: perplexity +2.5%" in choice.summary()


def test_where_no_wide_blocks_keep_the_rule_blocks_of_32_serve_unmeasured():
    choice, built = choose({128: 9.0, 64: 3.0})
    assert (choice.block, choice.rise, built) == (32, None, [128, 64, 32])
    assert [block for block, _ in choice.refused] == [128, 64]


def test_a_measurement_that_breaks_passes_the_blocks_over_with_the_reason():
    choice, built = choose({128: RuntimeError("the measuring process died"), 64: 0.7})
    assert choice.block == 64
    assert choice.refused == ((128, "not measured, the measuring process died"),)


def test_4_bit_blocks_may_cost_two_points_more_than_blocks_of_32():
    choice, built = choose({32: 6.0, 128: 7.5}, block_choice.choose_4bit, wide=(128, 64))
    assert (choice.block, built) == (128, [32, 128]) and round(choice.rise.percent, 6) == 7.5
    assert choice.summary().endswith("topics) (blocks of 32: +6.0%)")  # what the budget was counted from
    choice, built = choose({32: 6.0, 128: 8.5, 64: 7.9}, block_choice.choose_4bit, wide=(128, 64))
    assert (choice.block, built) == (64, [32, 128, 64])
    assert choice.refused == ((128, "perplexity +8.5% over float32, past +8.0%"),)


def test_4_bit_blocks_of_32_serve_measured_where_no_wider_ones_keep_the_rule_or_can_be_stored():
    choice, built = choose({32: 6.0, 128: 9.0}, block_choice.choose_4bit, wide=(128,))
    assert (choice.block, choice.graph, built) == (32, Path("graph-32"), [32, 128])
    assert round(choice.rise.percent, 6) == 6.0  # measured once, not built twice
    choice, built = choose({32: 6.0}, block_choice.choose_4bit, wide=())
    assert (choice.block, built, choice.refused) == (32, [32], ())


def test_a_4_bit_measurement_of_blocks_of_32_that_breaks_is_raised():
    with pytest.raises(RuntimeError, match="died"):
        choose({32: RuntimeError("the measuring process died")}, block_choice.choose_4bit, wide=(128,))


@pytest.mark.parametrize("dims, packable", [
    ((576, 1536, 9, 64), ()),  # SmolLM2-135M (the bundled model): 576 inputs are 9 blocks of 64, 4.5 of 128
    ((1024, 2816, 16, 64), (128, 64)),  # Qwen1.5-0.5B
    ((896, 4864, 14, 64), (64,)),  # Qwen2.5-0.5B: 896 inputs are 7 blocks of 128
])
def test_4_bit_blocks_are_tried_only_where_every_row_holds_an_even_number_of_them(tmp_path, dims, packable):
    hidden, intermediate, heads, head_dim = dims
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "intermediate_size": intermediate,
                                                      "num_attention_heads": heads, "head_dim": head_dim}))
    assert packable_4bit(str(tmp_path), block_choice.WIDE) == packable
