"""The dashboard's server-side SVG plot (kiln.dashboard.svg): points, axes, empty data,
escaping, and that the output is well-formed XML with nothing external."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from kiln.dashboard.svg import Series, fmt, nice_ticks, step_plot

NS = "{http://www.w3.org/2000/svg}"


def _parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def test_points_become_circles_and_a_step_path_per_series() -> None:
    svg = step_plot(
        [
            Series("a (fast)", ((1.0, 100.0), (5.0, 150.0), (9.0, 180.0))),
            Series("b (full)", ((3.0, 90.0),)),
        ],
        title="best",
    )
    root = _parse(svg)
    groups = root.findall(f"{NS}g[@class='series']")
    assert [g.get("data-series") for g in groups] == ["a (fast)", "b (full)"]
    assert len(groups[0].findall(f"{NS}circle")) == 3
    assert len(groups[1].findall(f"{NS}circle")) == 1
    d = groups[0].find(f"{NS}path").get("d")  # type: ignore[union-attr]
    assert d.startswith("M") and d.count("H") == 3 and d.count("V") == 2  # type: ignore[union-attr]
    # Higher tokens/s is drawn higher (smaller y).
    ys = [float(c.get("cy", "0")) for c in groups[0].findall(f"{NS}circle")]
    assert ys[0] > ys[1] > ys[2]
    xs = [float(c.get("cx", "0")) for c in groups[0].findall(f"{NS}circle")]
    assert xs[0] < xs[1] < xs[2]


def test_axes_have_round_ticks_covering_the_data_and_labels() -> None:
    svg = step_plot([Series("s", ((0.0, 0.0), (37.0, 1234.0)))], x_label="sec", y_label="tok/s")
    assert 'class="x-axis"' in svg and 'class="y-axis"' in svg
    labels = re.findall(r">([0-9,.]+)</text>", svg)
    assert "0" in labels and "1,500" in labels and "40" in labels
    assert ">sec<" in svg and ">tok/s<" in svg


def test_empty_data_gives_a_frame_saying_so() -> None:
    for series in ([], [Series("nothing")]):
        svg = step_plot(series)
        root = _parse(svg)
        assert root.tag == f"{NS}svg"
        assert "no data yet" in svg
        assert not root.findall(f".//{NS}circle")


def test_held_to_x_max_and_non_finite_points_dropped() -> None:
    svg = step_plot(
        [Series("s", ((1.0, 10.0), (float("nan"), 5.0), (2.0, float("inf"))))], x_max=100.0
    )
    assert svg.count("<circle") == 1
    assert ">100<" in svg  # the axis reaches x_max


def test_names_are_escaped_and_nothing_external_is_referenced() -> None:
    evil = '<script>alert("x")</script>&'
    svg = step_plot([Series(evil, ((1.0, 2.0),))], title=evil)
    assert "<script" not in svg
    assert "&lt;script&gt;" in svg
    _parse(svg)  # still well-formed
    assert "href" not in svg and "url(" not in svg


def test_nice_ticks_and_fmt() -> None:
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0, 0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    ticks = nice_ticks(0, 173)
    assert ticks[0] == 0 and ticks[-1] >= 173 and len(ticks) <= 7
    assert fmt(1500) == "1,500" and fmt(2.0) == "2" and fmt(0.25) == "0.25"
