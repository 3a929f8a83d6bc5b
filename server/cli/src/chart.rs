//! A small line chart written as PNG: accuracy per round, with axes, tick
//! labels and a legend in a built-in 5×7 pixel font (no font files).

use std::io::BufWriter;
use std::path::Path;

use anyhow::{Context, Result};

const WIDTH: usize = 800;
const HEIGHT: usize = 500;
const LEFT: usize = 70;
const RIGHT: usize = 20;
const TOP: usize = 40;
const BOTTOM: usize = 60;
const SCALE: usize = 2;

type Rgb = [u8; 3];
const WHITE: Rgb = [255, 255, 255];
const BLACK: Rgb = [30, 30, 30];
const GRID: Rgb = [225, 225, 225];
/// Series colours: blue, orange, green, red.
const COLOURS: [Rgb; 4] = [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40]];

/// One line of the chart.
pub struct Series<'a> {
    /// Legend text.
    pub label: &'a str,
    /// (round, value) points.
    pub points: Vec<(f64, f64)>,
}

struct Canvas {
    pixels: Vec<u8>,
}

impl Canvas {
    fn new() -> Self {
        Self { pixels: WHITE.repeat(WIDTH * HEIGHT) }
    }

    fn set(&mut self, x: i64, y: i64, colour: Rgb) {
        if (0..WIDTH as i64).contains(&x) && (0..HEIGHT as i64).contains(&y) {
            let i = (y as usize * WIDTH + x as usize) * 3;
            self.pixels[i..i + 3].copy_from_slice(&colour);
        }
    }

    fn rect(&mut self, x: i64, y: i64, w: i64, h: i64, colour: Rgb) {
        for dy in 0..h {
            for dx in 0..w {
                self.set(x + dx, y + dy, colour);
            }
        }
    }

    /// A line `thickness` pixels wide (Bresenham with a square pen).
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), colour: Rgb, thickness: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut error) = (x0, y0, dx + dy);
        loop {
            self.rect(x - thickness / 2, y - thickness / 2, thickness, thickness, colour);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * error;
            if e2 >= dy {
                error += dy;
                x += sx;
            }
            if e2 <= dx {
                error += dx;
                y += sy;
            }
        }
    }

    /// Text with its top-left corner at (x, y).
    fn text(&mut self, x: i64, y: i64, text: &str, colour: Rgb) {
        for (i, c) in text.chars().enumerate() {
            let rows = glyph(c);
            for (row, bits) in rows.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0b10000 >> col) != 0 {
                        let (px, py) = (x + ((i * 6 + col) * SCALE) as i64, y + (row * SCALE) as i64);
                        self.rect(px, py, SCALE as i64, SCALE as i64, colour);
                    }
                }
            }
        }
    }

    fn text_width(text: &str) -> i64 {
        (text.chars().count() * 6 * SCALE) as i64
    }
}

/// Writes the chart of `series` (values in [0, 1], shown as percent, per
/// round) to `path`.
pub fn write_accuracy_chart(path: &Path, title: &str, series: &[Series<'_>]) -> Result<()> {
    write_chart(path, title, "ROUND", series)
}

/// Writes the chart of `series` (values in [0, 1], shown as percent; x from
/// 0, ticks at whole numbers) to `path`, the x axis named `x_label`.
pub fn write_chart(path: &Path, title: &str, x_label: &str, series: &[Series<'_>]) -> Result<()> {
    let mut canvas = Canvas::new();
    let rounds = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).fold(1.0f64, f64::max);
    let values = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    // The y range: from the lowest value rounded down to 10 % up to 100 %.
    let low = (values.fold(1.0f64, f64::min) * 10.0).floor().clamp(0.0, 9.0) / 10.0;
    let (plot_w, plot_h) = ((WIDTH - LEFT - RIGHT) as f64, (HEIGHT - TOP - BOTTOM) as f64);
    let to_pixel = |(round, value): (f64, f64)| {
        let x = LEFT as f64 + (round / rounds) * plot_w;
        let y = TOP as f64 + (1.0 - (value - low) / (1.0 - low)) * plot_h;
        (x.round() as i64, y.round() as i64)
    };
    // Grid and y ticks every 10 %, or 5 % when the range is narrow.
    let step = if 1.0 - low <= 0.3 { 0.05 } else { 0.1 };
    let mut tick = low;
    while tick <= 1.0 + 1e-9 {
        let (_, y) = to_pixel((0.0, tick));
        canvas.line((LEFT as i64, y), ((WIDTH - RIGHT) as i64, y), GRID, 1);
        let label = format!("{:.0}%", tick * 100.0);
        canvas.text(LEFT as i64 - 10 - Canvas::text_width(&label), y - 7, &label, BLACK);
        tick += step;
    }
    // x ticks at about ten round numbers.
    let x_step = ((rounds / 10.0).ceil() as u64).max(1);
    for round in (0..=rounds as u64).step_by(x_step as usize) {
        let (x, _) = to_pixel((round as f64, low));
        canvas.line((x, (HEIGHT - BOTTOM) as i64), (x, (HEIGHT - BOTTOM + 6) as i64), BLACK, 1);
        let label = round.to_string();
        canvas.text(x - Canvas::text_width(&label) / 2, (HEIGHT - BOTTOM + 12) as i64, &label, BLACK);
    }
    // Axes, title, axis names.
    let (left, bottom) = (LEFT as i64, (HEIGHT - BOTTOM) as i64);
    canvas.line((left, TOP as i64), (left, bottom), BLACK, 2);
    canvas.line((left, bottom), ((WIDTH - RIGHT) as i64, bottom), BLACK, 2);
    canvas.text((WIDTH as i64 - Canvas::text_width(title)) / 2, 10, title, BLACK);
    canvas.text((WIDTH as i64 - Canvas::text_width(x_label)) / 2, (HEIGHT - 22) as i64, x_label, BLACK);
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        for pair in s.points.windows(2) {
            canvas.line(to_pixel(pair[0]), to_pixel(pair[1]), colour, 3);
        }
        for &point in &s.points {
            let (x, y) = to_pixel(point);
            canvas.rect(x - 3, y - 3, 7, 7, colour);
        }
        // Legend, bottom right inside the plot.
        let y = bottom - 30 - 22 * (series.len() - 1 - i) as i64;
        let x = (WIDTH - RIGHT) as i64 - 40 - Canvas::text_width(s.label);
        canvas.rect(x, y + 4, 24, 6, colour);
        canvas.text(x + 32, y, s.label, BLACK);
    }
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut encoder = png::Encoder::new(BufWriter::new(file), WIDTH as u32, HEIGHT as u32);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().context("writing the PNG header")?;
    writer.write_image_data(&canvas.pixels).context("writing the PNG data")?;
    writer.finish().context("finishing the PNG")?;
    Ok(())
}

/// 5×7 glyphs, one byte per row (low five bits); lower case is drawn as
/// upper case, unknown characters as blanks.
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        '/' => [0, 0x01, 0x02, 0x04, 0x08, 0x10, 0],
        _ => [0; 7],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_is_a_png_with_the_series_drawn() {
        let path = std::env::temp_dir().join(format!("cohort-chart-{}.png", std::process::id()));
        let secure = Series { label: "secure", points: vec![(1.0, 0.5), (2.0, 0.7), (3.0, 0.8)] };
        write_accuracy_chart(&path, "TEST", &[secure]).unwrap();
        let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut pixels).unwrap();
        assert_eq!((info.width, info.height), (WIDTH as u32, HEIGHT as u32));
        // The series colour is on the canvas, at the last point's marker.
        let blue = pixels.chunks_exact(3).filter(|p| *p == COLOURS[0]).count();
        assert!(blue > 100, "{blue} blue pixels");
        std::fs::remove_file(&path).unwrap();
    }
}
