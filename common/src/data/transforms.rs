//! From an image file's bytes to the `3 × S × S` bytes of a batch: decoding and torchvision's
//! ImageNet transforms, in plain Rust so that they run on the loader's worker threads.
//!
//! - Decoding: the `image` crate (JPEG through zune-jpeg, PNG, BMP, PPM/PGM, WebP; TIFF, which
//!   torchvision lists but no image data set uses, is not built in: such a file is an error
//!   naming it), then
//!   to RGB as PIL's `convert("RGB")` does (grey replicated, alpha dropped, CMYK converted).
//! - Resizing: `fast_image_resize`'s convolution with Pillow's bilinear filter, widened when
//!   shrinking (what PIL's `resize(..., BILINEAR)` computes, on SIMD).
//! - Recipes ([`Transform`]): `RandomResizedCrop(S)` + `RandomHorizontalFlip()` for training,
//!   `Resize(R)` + `CenterCrop(S)` for evaluation, or JSC's `Resize((S, S))` for both.
//!
//! The random draws follow torchvision's algorithm (the same distribution; not the same numbers,
//! which come from torch's generator there and from a seeded ChaCha stream per image here).
//! The flip and the move from the decoder's `H × W × C` to the batch's `C × H × W` are one pass.
use anyhow::{anyhow, Context, Result};
use fast_image_resize::images::{CroppedImage, Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// What becomes of an image on its way into a batch of `S × S` images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Transform {
    /// torchvision's training recipe: `RandomResizedCrop(size)` (scale 0.08–1, aspect ratio
    /// 3/4–4/3) then `RandomHorizontalFlip()`.
    RandomResizedCrop { size: u32 },
    /// torchvision's evaluation recipe: `Resize(resize)` (the shorter side to `resize`, the
    /// aspect ratio kept) then `CenterCrop(size)`.
    ResizeCenterCrop { resize: u32, size: u32 },
    /// `Resize((size, size))`, the aspect ratio not kept (the JSC course's, for training and
    /// evaluation alike).
    Resize { size: u32 },
}

/// `RandomResizedCrop`'s defaults: the crop's share of the image's area and its aspect ratio.
const CROP_SCALE: (f64, f64) = (0.08, 1.0);
const CROP_RATIO: (f64, f64) = (3.0 / 4.0, 4.0 / 3.0);

/// A crop of an image, in pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropBox {
    pub top: u32,
    pub left: u32,
    pub height: u32,
    pub width: u32,
}

impl Transform {
    /// The ImageNet recipe at `size` (224 in torchvision's references): `RandomResizedCrop` for
    /// training, and for evaluation `Resize(size / 0.875)` (256 for 224) then `CenterCrop`.
    pub fn imagenet(size: u32, train: bool) -> Transform {
        match train {
            true => Transform::RandomResizedCrop { size },
            false => Transform::ResizeCenterCrop { resize: (size as f64 / 0.875).floor() as u32, size },
        }
    }

    /// The side of the images this transform makes.
    pub fn size(self) -> u32 {
        match self {
            Transform::RandomResizedCrop { size } | Transform::ResizeCenterCrop { size, .. } | Transform::Resize { size } => size,
        }
    }

    /// Decodes `encoded` and writes the transformed image into `out` (`3 × S × S` bytes, channel
    /// planes), drawing what is random from `rng`, in the buffers of `scratch`.
    pub fn apply(self, encoded: &[u8], out: &mut [u8], rng: &mut ChaCha8Rng, scratch: &mut Scratch) -> Result<()> {
        let Scratch { resizer, decoded, resized } = scratch;
        let (width, height) = decode_into(encoded, decoded)?;
        let source = ImageRef::new(width, height, decoded, PixelType::U8x3).map_err(|e| anyhow!("{e}"))?;
        let size = self.size();
        if (resized.width(), resized.height()) != (size, size) {
            *resized = Image::new(size, size, PixelType::U8x3);
        }
        let bilinear = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
        let flip = match self {
            Transform::RandomResizedCrop { .. } => {
                // torchvision crops first, then resizes the crop: the filter stops at the crop's edges.
                let crop = random_resized_crop(width, height, rng);
                let cropped = CroppedImage::new(&source, crop.left, crop.top, crop.width, crop.height).map_err(|e| anyhow!("{e}"))?;
                resizer.resize(&cropped, resized, &bilinear)?;
                rng.random_bool(0.5)
            }
            Transform::ResizeCenterCrop { resize, size } => {
                // The central `size × size` of the image resized to `resize` on its shorter side,
                // computed directly: only those pixels are resampled, each as the whole resize
                // would (the filter stops at the image's edges, not the crop's).
                let (scaled_w, scaled_h) = resized_shorter_side(width, height, resize);
                let (top, left) = (center_offset(scaled_h, size), center_offset(scaled_w, size));
                if scaled_w < size || scaled_h < size {
                    return Err(anyhow!("a {width}×{height} image resized to {scaled_w}×{scaled_h} is smaller than the {size}×{size} centre crop"));
                }
                let (sx, sy) = (width as f64 / scaled_w as f64, height as f64 / scaled_h as f64);
                let options = bilinear.crop(left as f64 * sx, top as f64 * sy, size as f64 * sx, size as f64 * sy);
                resizer.resize(&source, resized, &options)?;
                false
            }
            Transform::Resize { .. } => {
                resizer.resize(&source, resized, &bilinear)?;
                false
            }
        };
        to_channel_planes(resized.buffer(), size as usize, flip, out);
        Ok(())
    }
}

/// The buffers a worker's transforms reuse from one image to the next: the resizer's, the
/// decoded image's and the resized one's (fresh buffers of half a megabyte per image cost page
/// faults that showed in profiles).
pub struct Scratch {
    resizer: Resizer,
    decoded: Vec<u8>,
    resized: Image<'static>,
}

impl Default for Scratch {
    fn default() -> Self {
        Scratch { resizer: Resizer::new(), decoded: Vec::new(), resized: Image::new(1, 1, PixelType::U8x3) }
    }
}

/// An image file's bytes decoded to 8-bit RGB (the format recognised from the bytes).
pub fn decode(encoded: &[u8]) -> Result<image::RgbImage> {
    let mut pixels = Vec::new();
    let (width, height) = decode_into(encoded, &mut pixels)?;
    Ok(image::RgbImage::from_raw(width, height, pixels).expect("width × height × 3 bytes"))
}

/// [`decode`] into `pixels` (`width × height × 3` bytes, resized to fit): returns the size.
fn decode_into(encoded: &[u8], pixels: &mut Vec<u8>) -> Result<(u32, u32)> {
    use image::ImageDecoder;
    let mut reader = image::ImageReader::new(std::io::Cursor::new(encoded)).with_guessed_format().context("cannot read the image")?;
    // The decoder's own allocations bounded too (the largest image allowed, 4 bytes a pixel):
    // image's default, 512 MiB, would refuse images PIL takes.
    let mut limits = image::Limits::default();
    limits.max_alloc = Some(4 * crate::data::MAX_IMAGE_PIXELS + (64 << 20));
    reader.limits(limits);
    if reader.format() == Some(image::ImageFormat::Jpeg) && !jpeg_is_complete(encoded) {
        // The decoder fills what is missing with grey and says nothing; PIL refuses ("image file
        // is truncated"), and so do we: a file cut short is a copy gone wrong, to be named.
        return Err(anyhow!("cannot decode the image: the JPEG is cut short (no end marker after its last scan)"));
    }
    let decoder = reader.into_decoder().context("cannot decode the image")?;
    let (width, height) = decoder.dimensions();
    let pixels_claimed = width as u64 * height as u64;
    if pixels_claimed > crate::data::MAX_IMAGE_PIXELS {
        return Err(anyhow!(
            "the image claims {width} × {height} = {pixels_claimed} pixels, more than the {} allowed (PIL refuses it too: a decompression bomb?)",
            crate::data::MAX_IMAGE_PIXELS
        ));
    }
    if decoder.color_type() == image::ColorType::Rgb8 {
        pixels.resize(decoder.total_bytes() as usize, 0);
        decoder.read_image(pixels).context("cannot decode the image")?;
    } else {
        let rgb = image::DynamicImage::from_decoder(decoder).context("cannot decode the image")?.into_rgb8();
        pixels.clear();
        pixels.extend_from_slice(rgb.as_raw());
    }
    Ok((width, height))
}

/// Whether a JPEG ends with an end-of-image marker (FF D9) after its last scan (FF DA). Inside a
/// scan a data byte FF is always followed by 00 or a restart marker (FF D0–D7), so FF D9 can
/// only be an end: the main image's, or, before the main image's scans, an embedded thumbnail's.
/// Searched from the end, where it is.
fn jpeg_is_complete(bytes: &[u8]) -> bool {
    let end = bytes.windows(2).rposition(|pair| pair == [0xFF, 0xD9]);
    end.is_some_and(|end| !bytes[end..].windows(2).any(|pair| pair == [0xFF, 0xDA]))
}

/// torchvision's `RandomResizedCrop.get_params`: ten tries at a random area share and aspect
/// ratio (log-uniform) that fit the image, placed uniformly; else the largest central crop of
/// an aspect ratio within bounds.
pub fn random_resized_crop(width: u32, height: u32, rng: &mut ChaCha8Rng) -> CropBox {
    let area = width as f64 * height as f64;
    let (log_min, log_max) = (CROP_RATIO.0.ln(), CROP_RATIO.1.ln());
    for _ in 0..10 {
        let target_area = area * rng.random_range(CROP_SCALE.0..CROP_SCALE.1);
        let aspect_ratio = rng.random_range(log_min..log_max).exp();
        let w = round_half_even((target_area * aspect_ratio).sqrt()) as u32;
        let h = round_half_even((target_area / aspect_ratio).sqrt()) as u32;
        if 0 < w && w <= width && 0 < h && h <= height {
            let top = rng.random_range(0..=height - h);
            let left = rng.random_range(0..=width - w);
            return CropBox { top, left, height: h, width: w };
        }
    }
    let in_ratio = width as f64 / height as f64;
    let (w, h) = if in_ratio < CROP_RATIO.0 {
        (width, round_half_even(width as f64 / CROP_RATIO.0) as u32)
    } else if in_ratio > CROP_RATIO.1 {
        (round_half_even(height as f64 * CROP_RATIO.1) as u32, height)
    } else {
        (width, height)
    };
    CropBox { top: (height - h) / 2, left: (width - w) / 2, height: h, width: w }
}

/// torchvision's `Resize(side)` on a `width × height` image: the shorter side becomes `side`,
/// the longer `int(side · long / short)` (truncated, as there).
pub fn resized_shorter_side(width: u32, height: u32, side: u32) -> (u32, u32) {
    let (short, long) = (width.min(height) as u64, width.max(height) as u64);
    let long = (side as u64 * long / short) as u32;
    if width <= height {
        (side, long)
    } else {
        (long, side)
    }
}

/// torchvision's `CenterCrop` offset: `int(round((have − want) / 2))`, Python's round (half to even).
pub fn center_offset(have: u32, want: u32) -> u32 {
    round_half_even((have as f64 - want as f64) / 2.0).max(0.0) as u32
}

/// Python's `round`: halves to the even neighbour.
fn round_half_even(x: f64) -> f64 {
    let rounded = x.round();
    if (x - x.trunc()).abs() == 0.5 && rounded % 2.0 != 0.0 {
        rounded - x.signum()
    } else {
        rounded
    }
}

/// `S × S × 3` pixels → three `S × S` channel planes, mirrored left to right with `flip`.
fn to_channel_planes(pixels: &[u8], side: usize, flip: bool, out: &mut [u8]) {
    let plane = side * side;
    assert_eq!(out.len(), 3 * plane, "room for 3 × {side} × {side} bytes");
    let (red, rest) = out.split_at_mut(plane);
    let (green, blue) = rest.split_at_mut(plane);
    for (y, row) in pixels.chunks_exact(3 * side).enumerate() {
        for (x, pixel) in row.chunks_exact(3).enumerate() {
            let at = y * side + if flip { side - 1 - x } else { x };
            (red[at], green[at], blue[at]) = (pixel[0], pixel[1], pixel[2]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn random_crops_stay_inside_the_image_within_torchvisions_bounds() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for (width, height) in [(500, 375), (375, 500), (224, 224), (1000, 50), (50, 1000), (7, 5), (1, 1)] {
            let mut areas = Vec::new();
            for _ in 0..300 {
                let crop = random_resized_crop(width, height, &mut rng);
                assert!(crop.width > 0 && crop.height > 0, "{crop:?}");
                assert!(crop.left + crop.width <= width && crop.top + crop.height <= height, "{crop:?} in {width}×{height}");
                areas.push((crop.width * crop.height) as f64 / (width * height) as f64);
            }
            if (width, height) == (500, 375) {
                // Areas spread over 8–100% (rounding aside); aspect ratios within 3/4–4/3 (ditto).
                let (least, most) = areas.iter().fold((f64::MAX, 0f64), |(a, b), &x| (a.min(x), b.max(x)));
                assert!(least < 0.15 && least > 0.075 && most > 0.8, "areas {least}..{most}");
            }
        }
        // A strip too thin for any ratio in bounds falls back to the largest central crop.
        let crop = random_resized_crop(1000, 50, &mut rng);
        assert!(crop.width <= 67, "{crop:?}");
    }

    #[test]
    fn pythons_rounding_and_torchvisions_resize_and_centre_crop_arithmetic() {
        assert_eq!([0.5, 1.5, 2.5, -0.5, 2.4, 2.6].map(round_half_even), [0.0, 2.0, 2.0, -0.0, 2.0, 3.0]);
        assert_eq!(center_offset(257, 224), 16); // 16.5 → 16
        assert_eq!(center_offset(259, 224), 18); // 17.5 → 18
        assert_eq!(resized_shorter_side(500, 375, 256), (341, 256));
        assert_eq!(resized_shorter_side(333, 500, 256), (256, 384));
        assert_eq!(Transform::imagenet(224, false), Transform::ResizeCenterCrop { resize: 256, size: 224 });
        assert_eq!(Transform::imagenet(64, false), Transform::ResizeCenterCrop { resize: 73, size: 64 });
    }

    fn encode_png(width: u32, height: u32, pixel: impl Fn(u32, u32) -> [u8; 3]) -> Vec<u8> {
        let image = image::RgbImage::from_fn(width, height, |x, y| image::Rgb(pixel(x, y)));
        let mut bytes = Vec::new();
        image.write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png).unwrap();
        bytes
    }

    #[test]
    fn the_transforms_make_channel_planes_and_the_flip_mirrors() {
        // A horizontal ramp in red, constant green and blue: resizing keeps the ramp's direction,
        // the flip reverses it.
        let png = encode_png(40, 30, |x, _| [(x * 6) as u8, 100, 200]);
        let mut scratch = Scratch::default();
        for transform in [Transform::Resize { size: 16 }, Transform::ResizeCenterCrop { resize: 20, size: 16 }, Transform::RandomResizedCrop { size: 16 }] {
            let mut flipped_seen = (false, false);
            for seed in 0..20 {
                let mut out = vec![0u8; 3 * 16 * 16];
                transform.apply(&png, &mut out, &mut ChaCha8Rng::seed_from_u64(seed), &mut scratch).unwrap();
                assert!(out[256..512].iter().all(|&g| g == 100) && out[512..].iter().all(|&b| b == 200), "{transform:?}: green and blue planes");
                let row = &out[16 * 8..16 * 9];
                let rising = row.windows(2).all(|w| w[0] <= w[1]) && row[0] < row[15];
                let falling = row.windows(2).all(|w| w[0] >= w[1]) && row[0] > row[15];
                assert!(rising || falling, "{transform:?}: {row:?}");
                flipped_seen = (flipped_seen.0 || rising, flipped_seen.1 || falling);
            }
            let flips = matches!(transform, Transform::RandomResizedCrop { .. });
            assert_eq!(flipped_seen, (true, flips), "{transform:?}: only the training transform flips, half of the time");
        }
    }

    #[test]
    fn the_centre_crop_is_the_middle_of_the_whole_resize() {
        // Resizing 40×30 to 20 on its shorter side (26×20) and cropping 16×16 from the middle
        // equals resampling just that middle: compare against the whole resize, then the crop.
        let png = encode_png(40, 30, |x, y| [(x * 6) as u8, (y * 8) as u8, ((x * y) % 251) as u8]);
        let mut out = vec![0u8; 3 * 16 * 16];
        Transform::ResizeCenterCrop { resize: 20, size: 16 }.apply(&png, &mut out, &mut ChaCha8Rng::seed_from_u64(0), &mut Scratch::default()).unwrap();
        let decoded = decode(&png).unwrap();
        let mut whole = Image::new(26, 20, PixelType::U8x3);
        let source = ImageRef::new(40, 30, decoded.as_raw(), PixelType::U8x3).unwrap();
        Resizer::new().resize(&source, &mut whole, &ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))).unwrap();
        let (top, left) = (center_offset(20, 16) as usize, center_offset(26, 16) as usize);
        for y in 0..16 {
            for x in 0..16 {
                for c in 0..3 {
                    let expected = whole.buffer()[((top + y) * 26 + left + x) * 3 + c] as i32;
                    let got = out[c * 256 + y * 16 + x] as i32;
                    assert!((expected - got).abs() <= 1, "({x}, {y}) channel {c}: {got} vs {expected}");
                }
            }
        }
    }

    #[test]
    fn an_image_claiming_more_pixels_than_pils_limit_is_refused_before_decoding() {
        let photo = image::RgbImage::from_fn(16, 16, |x, y| image::Rgb([x as u8 * 8, y as u8 * 8, 0]));
        let mut jpeg = Vec::new();
        photo.write_to(&mut std::io::Cursor::new(&mut jpeg), image::ImageFormat::Jpeg).unwrap();
        let sof = jpeg.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        for (width, height, refused) in [(60000u16, 60000u16, true), (13377, 13378, true), (200, 100, false)] {
            let mut claimed = jpeg.clone();
            claimed[sof + 5..sof + 7].copy_from_slice(&height.to_be_bytes());
            claimed[sof + 7..sof + 9].copy_from_slice(&width.to_be_bytes());
            // Over the limit (13377 × 13378 is just past it): refused by the pixel count, with
            // nothing allocated. Under it, decoded (the missing blocks grey) or refused for
            // another reason, never for its size.
            let said = decode(&claimed).map_or_else(|e| e.to_string(), |_| String::new());
            assert_eq!(said.contains("more than the 178956970 allowed"), refused, "{width} × {height}: {said}");
        }
    }

    #[test]
    fn grey_and_alpha_images_become_rgb_and_garbage_is_an_error() {
        let grey = image::GrayImage::from_fn(8, 8, |x, _| image::Luma([(x * 30) as u8]));
        let mut jpeg = Vec::new();
        grey.write_to(&mut std::io::Cursor::new(&mut jpeg), image::ImageFormat::Jpeg).unwrap();
        let rgb = decode(&jpeg).unwrap();
        assert!(rgb.pixels().all(|p| p[0] == p[1] && p[1] == p[2]), "grey replicated");
        let rgba = image::RgbaImage::from_fn(4, 4, |_, _| image::Rgba([10, 20, 30, 0]));
        let mut png = Vec::new();
        rgba.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
        assert!(decode(&png).unwrap().pixels().all(|p| p.0 == [10, 20, 30]), "alpha dropped, not composited");
        let err = format!("{:#}", decode(b"not an image at all").unwrap_err());
        assert!(err.contains("cannot"), "{err}");
        // Cut anywhere, even just before its end marker: an error (the decoder alone would
        // return a partly grey image for the larger cuts).
        let photo = image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([(x * 4) as u8, (y * 5) as u8, ((x * y) % 256) as u8]));
        let mut jpeg = Vec::new();
        photo.write_to(&mut std::io::Cursor::new(&mut jpeg), image::ImageFormat::Jpeg).unwrap();
        assert!(decode(&jpeg).is_ok());
        for cut in [jpeg.len() / 3, jpeg.len() / 2, jpeg.len() - 2] {
            let err = format!("{:#}", decode(&jpeg[..cut]).unwrap_err());
            assert!(err.contains("cannot decode"), "cut at {cut}: {err}");
        }
    }
}
