//! PNG bytes of a chart drawn in memory (8-bit RGB), so that `zrun plot` writes the file
//! itself and a failed write is a plain `io::Error` (the `image` crate's file writer turns it
//! into text and drops the error of its last flush).
//!
//! Each row is filtered the way that leaves the smallest bytes (None, Sub, Up or Paeth; PNG
//! spec 12.8), and the rows are compressed by a small DEFLATE (RFC 1951): greedy LZ77 matches
//! over a 32 KiB window, coded with the fixed Huffman codes (3.2.6). Charts are mostly flat
//! colour, which this shrinks about as well as a general encoder; text costs a little more.

/// Lengths 3..=258: the base of each length code 257..=285 (RFC 1951 3.2.5).
const LEN_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
/// Extra bits after each length code.
const LEN_EXTRA: [u8; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];
/// Distances 1..=32768: the base of each distance code 0..=29.
const DIST_BASE: [u16; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537,
    2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577,
];
/// Extra bits after each distance code.
const DIST_EXTRA: [u8; 30] = [
    0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13,
    13,
];
/// How far back a match may start.
const WINDOW: usize = 1 << 15;
/// The longest match.
const MAX_MATCH: usize = 258;
/// Earlier positions with the same 3-byte hash tried per match (zlib's level 6 tries 128).
const CHAIN: usize = 32;
/// Bytes per pixel (RGB).
const BPP: usize = 3;

/// The PNG file of an RGB image `size` (width, height) pixels, `rgb` row by row.
pub fn encode(rgb: &[u8], (w, h): (u32, u32)) -> Vec<u8> {
    let row = BPP * w as usize;
    debug_assert_eq!(rgb.len(), row * h as usize);
    let mut raw = Vec::with_capacity((row + 1) * h as usize);
    let zeros = vec![0; row];
    for (i, line) in rgb.chunks_exact(row.max(1)).enumerate() {
        let above = if i == 0 {
            &zeros[..]
        } else {
            &rgb[(i - 1) * row..i * row]
        };
        filter(line, above, &mut raw);
    }
    let mut ihdr = Vec::with_capacity(13);
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    // Bit depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace.
    ihdr.extend([8, 2, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &zlib(&raw));
    chunk(&mut out, b"IEND", &[]);
    out
}

/// Appends `line` filtered against the row `above`, its filter type byte first: the filter
/// whose output has the smallest sum of bytes taken as signed (the spec's heuristic).
fn filter(line: &[u8], above: &[u8], raw: &mut Vec<u8>) {
    let left = |i: usize| if i >= BPP { line[i - BPP] } else { 0 };
    let corner = |i: usize| if i >= BPP { above[i - BPP] } else { 0 };
    let pred: [&dyn Fn(usize) -> u8; 4] = [&|_| 0, &left, &|i| above[i], &|i| {
        paeth(left(i), above[i], corner(i))
    }];
    let cost = |p: &dyn Fn(usize) -> u8| -> u64 {
        (0..line.len())
            .map(|i| u64::from((line[i].wrapping_sub(p(i)) as i8).unsigned_abs()))
            .sum()
    };
    let best = (0..pred.len()).min_by_key(|&k| cost(pred[k])).unwrap_or(0);
    // PNG's filter types: 0 None, 1 Sub, 2 Up, 4 Paeth.
    raw.push([0, 1, 2, 4][best]);
    raw.extend((0..line.len()).map(|i| line[i].wrapping_sub(pred[best](i))));
}

/// The Paeth predictor: of left `a`, above `b` and upper-left `c`, the one nearest a + b - c.
fn paeth(a: u8, b: u8, c: u8) -> u8 {
    let p = i16::from(a) + i16::from(b) - i16::from(c);
    let (pa, pb, pc) = (
        (p - i16::from(a)).abs(),
        (p - i16::from(b)).abs(),
        (p - i16::from(c)).abs(),
    );
    if pa <= pb && pa <= pc {
        a
    } else if pb <= pc {
        b
    } else {
        c
    }
}

/// Appends a PNG chunk: length, type, data, CRC of type and data.
fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
    out.extend(len.to_be_bytes());
    let start = out.len();
    out.extend(kind);
    out.extend(data);
    out.extend(crc32(&out[start..]).to_be_bytes());
}

/// The zlib stream (RFC 1950) of `data`: header, one fixed-Huffman DEFLATE block, Adler-32.
fn zlib(data: &[u8]) -> Vec<u8> {
    let mut bits = Bits::default();
    // CMF 0x78 (deflate, 32 KiB window), FLG 0x01 (fastest level, header % 31 == 0).
    bits.out.extend([0x78, 0x01]);
    // BFINAL 1, BTYPE 01 (fixed Huffman codes).
    bits.put(1, 1);
    bits.put(1, 2);
    let mut m = Matcher::new(data);
    let mut i = 0;
    while i < data.len() {
        let (len, dist) = m.longest(i);
        if len >= 3 {
            bits.length(len);
            bits.distance(dist);
            for p in i..i + len {
                m.insert(p);
            }
            i += len;
        } else {
            bits.symbol(u32::from(data[i]));
            m.insert(i);
            i += 1;
        }
    }
    bits.symbol(256);
    let mut out = bits.finish();
    out.extend(adler32(data).to_be_bytes());
    out
}

/// LZ77's search: earlier positions of each 3-byte hash, latest first.
struct Matcher<'a> {
    data: &'a [u8],
    /// `head[h]`: the latest position inserted with hash `h`.
    head: Vec<usize>,
    /// `prev[p % WINDOW]`: the position inserted before `p` with `p`'s hash.
    prev: Vec<usize>,
}

impl<'a> Matcher<'a> {
    /// No position inserted yet.
    fn new(data: &'a [u8]) -> Self {
        Matcher {
            data,
            head: vec![usize::MAX; WINDOW],
            prev: vec![usize::MAX; WINDOW],
        }
    }

    /// The hash of the 3 bytes at `i`.
    fn hash(&self, i: usize) -> usize {
        let d = self.data;
        ((usize::from(d[i]) << 10) ^ (usize::from(d[i + 1]) << 5) ^ usize::from(d[i + 2]))
            & (WINDOW - 1)
    }

    /// Makes position `p` findable by later searches.
    fn insert(&mut self, p: usize) {
        if p + 3 <= self.data.len() {
            let h = self.hash(p);
            self.prev[p % WINDOW] = self.head[h];
            self.head[h] = p;
        }
    }

    /// The longest match (length, distance) for the bytes at `i` among the `CHAIN` latest
    /// inserted positions with their hash; length 0 when none has 3 bytes in common.
    fn longest(&self, i: usize) -> (usize, usize) {
        let d = self.data;
        if i + 3 > d.len() {
            return (0, 0);
        }
        let most = (d.len() - i).min(MAX_MATCH);
        let (mut len, mut dist) = (0, 0);
        let mut cand = self.head[self.hash(i)];
        // A position older than the window may have had its `prev` slot reused: stop there.
        for _ in 0..CHAIN {
            if cand == usize::MAX || i - cand > WINDOW {
                break;
            }
            let n = d[cand..]
                .iter()
                .zip(&d[i..i + most])
                .take_while(|(a, b)| a == b)
                .count();
            if n > len {
                (len, dist) = (n, i - cand);
                if n == most {
                    break;
                }
            }
            cand = self.prev[cand % WINDOW];
        }
        if len >= 3 {
            (len, dist)
        } else {
            (0, 0)
        }
    }
}

/// DEFLATE's bit stream: values packed from the least significant bit, Huffman codes from
/// their most significant bit.
#[derive(Default)]
struct Bits {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    /// Appends the low `len` bits of `v`.
    fn put(&mut self, v: u32, len: u32) {
        self.acc |= u64::from(v) << self.n;
        self.n += len;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    /// Appends the Huffman code `code` of `len` bits.
    fn code(&mut self, code: u32, len: u32) {
        self.put(code.reverse_bits() >> (32 - len), len);
    }

    /// Appends literal/length symbol `s` (0..=287) in the fixed code.
    fn symbol(&mut self, s: u32) {
        match s {
            0..=143 => self.code(0x30 + s, 8),
            144..=255 => self.code(0x190 + s - 144, 9),
            256..=279 => self.code(s - 256, 7),
            _ => self.code(0xC0 + s - 280, 8),
        }
    }

    /// Appends match length `len` (3..=258): its code and extra bits.
    fn length(&mut self, len: usize) {
        let k = LEN_BASE.partition_point(|&b| usize::from(b) <= len) - 1;
        self.symbol(257 + k as u32);
        self.put(
            (len - usize::from(LEN_BASE[k])) as u32,
            u32::from(LEN_EXTRA[k]),
        );
    }

    /// Appends match distance `dist` (1..=32768): its 5-bit code and extra bits.
    fn distance(&mut self, dist: usize) {
        let k = DIST_BASE.partition_point(|&b| usize::from(b) <= dist) - 1;
        self.code(k as u32, 5);
        self.put(
            (dist - usize::from(DIST_BASE[k])) as u32,
            u32::from(DIST_EXTRA[k]),
        );
    }

    /// The bytes, the last one padded with zero bits.
    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

/// CRC-32 (ISO-HDLC, PNG's) of `data`.
fn crc32(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    !data.iter().fold(!0u32, |c, &b| {
        TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8)
    })
}

/// Adler-32 (zlib's check) of `data`.
fn adler32(data: &[u8]) -> u32 {
    const MOD: u32 = 65521;
    let (mut a, mut b) = (1u32, 0u32);
    // 5552 bytes is the most that cannot overflow `b` before the reduction (zlib's NMAX).
    for block in data.chunks(5552) {
        for &x in block {
            a += u32::from(x);
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads a stream `zlib` wrote back (fixed Huffman blocks only), checking its Adler-32.
    fn inflate(z: &[u8]) -> Vec<u8> {
        assert_eq!(&z[..2], &[0x78, 0x01]);
        let (body, check) = z[2..].split_at(z.len() - 6);
        let mut pos = 0usize;
        let mut bit = |n: u32| -> u32 {
            let mut v = 0;
            for k in 0..n {
                v |= u32::from((body[pos / 8] >> (pos % 8)) & 1) << k;
                pos += 1;
            }
            v
        };
        assert_eq!(bit(3), 0b011, "one final fixed-Huffman block");
        let mut out: Vec<u8> = Vec::new();
        loop {
            // Huffman codes come most significant bit first.
            let mut code = 0u32;
            let mut len = 0;
            let sym = loop {
                code = (code << 1) | bit(1);
                len += 1;
                match (len, code) {
                    (7, 0..=23) => break 256 + code,
                    (8, 0x30..=0xBF) => break code - 0x30,
                    (8, 0xC0..=0xC7) => break 280 + code - 0xC0,
                    (9, 0x190..=0x1FF) => break 144 + code - 0x190,
                    _ => assert!(len < 9, "bad code {code:b}"),
                }
            };
            match sym {
                0..=255 => out.push(sym as u8),
                256 => break,
                _ => {
                    let k = (sym - 257) as usize;
                    let n = usize::from(LEN_BASE[k]) + bit(u32::from(LEN_EXTRA[k])) as usize;
                    let mut d = 0;
                    for _ in 0..5 {
                        d = (d << 1) | bit(1);
                    }
                    let d = d as usize;
                    let dist = usize::from(DIST_BASE[d]) + bit(u32::from(DIST_EXTRA[d])) as usize;
                    for _ in 0..n {
                        out.push(out[out.len() - dist]);
                    }
                }
            }
        }
        assert_eq!(check, adler32(&out).to_be_bytes());
        out
    }

    #[test]
    fn checksums_match_the_published_values() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
    }

    #[test]
    fn deflate_round_trips_runs_repeats_and_noise() {
        let mut data = vec![255u8; 100_000];
        data.extend((0..70_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8));
        data.extend(b"abcabcabcab".iter().cycle().take(40_000));
        data.extend((0..=255u8).cycle().take(50_000));
        for d in [&data[..], &[][..], &[7][..], &[1, 2][..]] {
            assert_eq!(inflate(&zlib(d)), d);
        }
        assert!(zlib(&data[..100_000]).len() < 1_000, "a flat run is tiny");
    }

    #[test]
    fn a_png_has_its_chunks_and_its_rows_unfilter_to_the_pixels() {
        let (w, h) = (37u32, 11u32);
        let rgb: Vec<u8> = (0..w * h * 3)
            .map(|i| if i % 7 == 0 { (i % 251) as u8 } else { 255 })
            .collect();
        let png = encode(&rgb, (w, h));
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert!(png.ends_with(&[0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82]));
        let (mut at, mut idat) = (8, Vec::new());
        while at < png.len() {
            let len = u32::from_be_bytes(png[at..at + 4].try_into().unwrap()) as usize;
            let body = &png[at + 4..at + 8 + len];
            let crc = u32::from_be_bytes(png[at + 8 + len..at + 12 + len].try_into().unwrap());
            assert_eq!(crc, crc32(body));
            if &body[..4] == b"IDAT" {
                idat.extend(&body[4..]);
            }
            at += 12 + len;
        }
        let raw = inflate(&idat);
        let row = 3 * w as usize;
        let mut pixels: Vec<u8> = Vec::new();
        for (i, line) in raw.chunks(row + 1).enumerate() {
            for (j, &x) in line[1..].iter().enumerate() {
                let a = if j >= 3 { pixels[i * row + j - 3] } else { 0 };
                let b = if i > 0 { pixels[(i - 1) * row + j] } else { 0 };
                let c = if i > 0 && j >= 3 {
                    pixels[(i - 1) * row + j - 3]
                } else {
                    0
                };
                let p = match line[0] {
                    0 => 0,
                    1 => a,
                    2 => b,
                    4 => paeth(a, b, c),
                    f => panic!("filter {f}"),
                };
                pixels.push(x.wrapping_add(p));
            }
        }
        assert_eq!(pixels, rgb);
    }
}
