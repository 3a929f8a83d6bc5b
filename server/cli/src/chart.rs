//! Line charts written as PNG (plotters, with antialiased DejaVu Sans text
//! from the `dejavu` crate: no font files on the machine): one or more
//! panels, each with its axes, its lines and a legend that says what each
//! line is.

use std::io::BufWriter;
use std::path::Path;
use std::sync::Once;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;
use plotters::style::FontStyle;

/// The chart's width, and each panel's height.
const WIDTH: u32 = 900;
const PANEL_HEIGHT: u32 = 360;
const TITLE_HEIGHT: u32 = 44;
const FONT: &str = "sans-serif";

/// Series colours: blue, orange, green, red, purple.
const COLOURS: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

/// One line of a panel.
pub struct Series<'a> {
    /// Legend text: what the line is.
    pub label: &'a str,
    /// (x, y) points.
    pub points: Vec<(f64, f64)>,
}

/// How a panel's y axis reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// Values in [0, 1] shown as percent, from the lowest value rounded
    /// down to 10 % up to 100 %.
    Percent,
    /// Values from 0 up to a little above the largest.
    FromZero,
}

/// One panel of a chart.
pub struct Panel<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub scale: Scale,
    pub series: Vec<Series<'a>>,
}

fn register_font() {
    static FONT_REGISTERED: Once = Once::new();
    FONT_REGISTERED.call_once(|| {
        // The bytes are a well-formed TrueType font; a failure here would
        // show as an error when the first text is drawn.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
    });
}

/// Writes one panel of accuracies (per cent) against `x_label` to `path`.
pub fn write_chart(path: &Path, title: &str, x_label: &str, series: Vec<Series<'_>>) -> Result<()> {
    let panel = Panel { title: "", x_label, y_label: "test accuracy", scale: Scale::Percent, series };
    write_panels(path, title, &[panel])
}

/// Writes `panels`, one above the other under `title`, to `path`.
pub fn write_panels(path: &Path, title: &str, panels: &[Panel<'_>]) -> Result<()> {
    register_font();
    let height = TITLE_HEIGHT + PANEL_HEIGHT * panels.len().max(1) as u32;
    let mut pixels = vec![255u8; (WIDTH * height * 3) as usize];
    draw(&mut pixels, height, title, panels).map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut encoder = png::Encoder::new(BufWriter::new(file), WIDTH, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().context("writing the PNG header")?;
    writer.write_image_data(&pixels).context("writing the PNG data")?;
    writer.finish().context("finishing the PNG")?;
    Ok(())
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn draw(pixels: &mut [u8], height: u32, title: &str, panels: &[Panel<'_>]) -> DrawResult {
    let root = BitMapBackend::with_buffer(pixels, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, body) = root.split_vertically(TITLE_HEIGHT);
    top.draw(&Text::new(
        title.to_string(),
        (WIDTH as i32 / 2, TITLE_HEIGHT as i32 / 2),
        (FONT, 22).into_font().color(&BLACK).pos(plotters::style::text_anchor::Pos::new(
            plotters::style::text_anchor::HPos::Center,
            plotters::style::text_anchor::VPos::Center,
        )),
    ))?;
    for (area, panel) in body.split_evenly((panels.len().max(1), 1)).iter().zip(panels) {
        draw_panel(area, panel)?;
    }
    root.present()?;
    Ok(())
}

fn draw_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    panel: &Panel<'_>,
) -> DrawResult {
    let points = || panel.series.iter().flat_map(|s| s.points.iter().copied());
    let x_min = points().map(|p| p.0).fold(0.0f64, f64::min);
    let x_max = points().map(|p| p.0).fold(1.0f64, f64::max);
    let (y_min, y_max) = match panel.scale {
        Scale::Percent => {
            ((points().map(|p| p.1).fold(1.0f64, f64::min) * 10.0).floor().clamp(0.0, 9.0) / 10.0, 1.0)
        }
        Scale::FromZero => {
            let top = points().map(|p| p.1).filter(|v| v.is_finite()).fold(0.0f64, f64::max);
            (0.0, if top > 0.0 { top * 1.08 } else { 1.0 })
        }
    };
    let mut builder = ChartBuilder::on(area);
    builder.margin(12).x_label_area_size(44).y_label_area_size(70);
    if !panel.title.is_empty() {
        builder.caption(panel.title, (FONT, 17));
    }
    let mut chart = builder.build_cartesian_2d(x_min..x_max, y_min..y_max)?;
    let percent = |v: &f64| format!("{:.0}%", v * 100.0);
    let plain = |v: &f64| tick(*v);
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(panel.x_label)
        .y_desc(panel.y_label)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(215, 215, 215))
        .x_label_formatter(&plain);
    match panel.scale {
        Scale::Percent => mesh.y_label_formatter(&percent),
        Scale::FromZero => mesh.y_label_formatter(&plain),
    };
    mesh.draw()?;
    for (i, series) in panel.series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(series.points.iter().copied(), colour.stroke_width(3)))?
            .label(series.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], colour.stroke_width(3)));
        chart.draw_series(series.points.iter().map(|&p| Circle::new(p, 4, colour.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .draw()?;
    Ok(())
}

/// A tick label: a whole number as such, anything else with at most three
/// decimals and no trailing zeros (0.30000000000000004 is "0.3").
fn tick(value: f64) -> String {
    if (value - value.round()).abs() < 1e-9 {
        // + 0.0 turns −0 into 0.
        return format!("{}", value.round() + 0.0);
    }
    let text = format!("{value:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(path: &Path) -> (u32, u32, Vec<u8>) {
        let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        (info.width, info.height, pixels)
    }

    fn count(pixels: &[u8], colour: RGBColor) -> usize {
        pixels.chunks_exact(3).filter(|p| *p == [colour.0, colour.1, colour.2]).count()
    }

    #[test]
    fn each_panel_draws_its_series_and_the_text_is_antialiased() {
        let path = std::env::temp_dir().join(format!("cohort-chart-{}.png", std::process::id()));
        let accuracy = Panel {
            title: "Test accuracy",
            x_label: "round",
            y_label: "accuracy",
            scale: Scale::Percent,
            series: vec![Series { label: "global model", points: vec![(1.0, 0.5), (2.0, 0.7), (3.0, 0.8)] }],
        };
        let loss = Panel {
            title: "Loss",
            x_label: "round",
            y_label: "loss",
            scale: Scale::FromZero,
            series: vec![
                Series { label: "test loss", points: vec![(1.0, 1.2), (2.0, 0.8), (3.0, 0.6)] },
                Series { label: "clients' training loss", points: vec![(1.0, 1.0), (2.0, 0.7), (3.0, 0.5)] },
            ],
        };
        write_panels(&path, "mnist logreg", &[accuracy, loss]).unwrap();
        let (width, height, pixels) = read(&path);
        assert_eq!((width, height), (WIDTH, TITLE_HEIGHT + 2 * PANEL_HEIGHT));
        let row = (WIDTH * 3) as usize;
        let top = &pixels[..row * (TITLE_HEIGHT + PANEL_HEIGHT) as usize];
        let bottom = &pixels[row * (TITLE_HEIGHT + PANEL_HEIGHT) as usize..];
        // The first panel's one line is blue; the second has blue and orange.
        assert!(count(top, COLOURS[0]) > 100 && count(top, COLOURS[1]) == 0);
        assert!(count(bottom, COLOURS[0]) > 100 && count(bottom, COLOURS[1]) > 100);
        // The title's glyphs have grey edges, not only black and white.
        let title = &pixels[..row * TITLE_HEIGHT as usize];
        let dark = title.chunks_exact(3).filter(|p| p[0] < 60 && p[0] == p[1] && p[1] == p[2]).count();
        let grey =
            title.chunks_exact(3).filter(|p| p[0] > 80 && p[0] < 200 && p[0] == p[1] && p[1] == p[2]).count();
        assert!(dark > 50 && grey > 50, "{dark} dark and {grey} grey pixels in the title");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(tick(0.1 + 0.2), "0.3");
        assert_eq!(tick(25.0), "25");
        assert_eq!(tick(-0.0), "0");
        assert_eq!(tick(0.125), "0.125");
        assert_eq!(tick(1.5), "1.5");
    }

    #[test]
    fn a_single_panel_chart_has_one_panel() {
        let path = std::env::temp_dir().join(format!("cohort-chart-one-{}.png", std::process::id()));
        let series = vec![Series { label: "secure", points: vec![(1.0, 0.5), (2.0, 0.7), (3.0, 0.8)] }];
        write_chart(&path, "TEST", "round", series).unwrap();
        let (width, height, pixels) = read(&path);
        assert_eq!((width, height), (WIDTH, TITLE_HEIGHT + PANEL_HEIGHT));
        assert!(count(&pixels, COLOURS[0]) > 100);
        std::fs::remove_file(&path).unwrap();
    }
}
