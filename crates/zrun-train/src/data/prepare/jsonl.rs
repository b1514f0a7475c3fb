//! JSON Lines inputs, plain, gzip or zstd: one JSON object per line, the document's text
//! under `--field`. Only that field is decoded (the others are skipped without building
//! them); blank lines and a byte-order mark at the start are skipped; the last of duplicate
//! keys wins, as in Python's `json`.

use std::fmt;
use std::io::{BufRead, BufReader};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::super::DataError;
use super::batches::{Halt, Origin, Sink};
use super::error::PrepareError;
use super::inputs::{Compression, Counted, Input};

/// What a line holds under the field.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    Text(String),
    /// Null, missing, or another JSON type (named).
    Not(&'static str),
}

/// Reads the documents of a JSON Lines file; bad lines are errors, or counted and skipped
/// with `skip_bad` (an unreadable stream skips the rest of the file).
pub(super) fn read(
    input: &Input,
    index: u32,
    compression: Compression,
    field: &str,
    skip_bad: bool,
    count: &Arc<AtomicU64>,
    sink: &mut Sink,
) -> Result<(), Halt> {
    let path = &input.path;
    let file = crate::data::open_regular(path).map_err(|source| DataError::Io {
        key: "input",
        path: path.clone(),
        op: "read",
        source,
    })?;
    let raw = BufReader::with_capacity(1 << 20, Counted::new(file, count.clone()));
    let (mut reader, op): (Box<dyn BufRead>, &'static str) = match compression {
        Compression::None => (Box::new(raw), "read"),
        Compression::Gzip => (
            Box::new(BufReader::with_capacity(
                1 << 20,
                flate2::bufread::MultiGzDecoder::new(raw),
            )),
            "decompress (gzip)",
        ),
        Compression::Zstd => {
            let op = "decompress (zstd)";
            let decoder =
                zstd::Decoder::with_buffer(raw).map_err(|e| unreadable(input, 0, op, &e))?;
            (Box::new(BufReader::with_capacity(1 << 20, decoder)), op)
        }
    };
    let mut line = Vec::new();
    let mut n = 0u64;
    loop {
        let read = match next_line(&mut reader, &mut line, MAX_LINE_BYTES) {
            Ok(Line::End) => return Ok(()),
            Ok(read) => {
                n += 1;
                read
            }
            Err(_) if skip_bad => {
                sink.skip();
                return Ok(());
            }
            Err(e) => return Err(unreadable(input, n, op, &e).into()),
        };
        if read == Line::TooLong {
            // One line would hold its whole size (a small compressed file can expand to
            // gigabytes of one line): refused, or read past and skipped.
            if !skip_bad {
                return Err(bad_line(
                    input,
                    n,
                    format!(
                        "longer than {} MiB, the most one document may hold (split the document)",
                        MAX_LINE_BYTES >> 20
                    ),
                )
                .into());
            }
            sink.skip();
            if let Err(e) = skip_line(&mut reader) {
                return Err(unreadable(input, n, op, &e).into());
            }
            continue;
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        // A byte-order mark before the first object (some Windows tools write one).
        let json = match line.strip_prefix(b"\xef\xbb\xbf") {
            Some(rest) if n == 1 => rest,
            _ => &line[..],
        };
        match text_of(json, field) {
            Ok(Found::Text(text)) => sink.document(index, Origin::Line(n), text)?,
            Ok(Found::Not(_)) | Err(_) if skip_bad => sink.skip(),
            Ok(Found::Not(what)) => {
                let problem = if what == "missing" {
                    format!("no field {field:?} ({})", keys(json))
                } else {
                    format!("field {field:?} is {what}, not a string")
                };
                return Err(bad_line(input, n, problem).into());
            }
            Err(e) => {
                let problem = format!("not a JSON object: {}", json_problem(&e));
                return Err(bad_line(input, n, problem).into());
            }
        }
    }
}

/// The longest line read: longer ones are refused (or skipped), so memory stays bounded.
pub(super) const MAX_LINE_BYTES: usize = 256 << 20;

/// How reading one line ended.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// Nothing was left.
    End,
    /// The whole line (with its newline, when it has one).
    Read,
    /// The line holds more than the cap besides its newline: `line` has the first cap + 1
    /// bytes, the rest is unread.
    TooLong,
}

/// Reads the next line into `line`, holding at most `cap` bytes of it besides its newline.
fn next_line(reader: &mut dyn BufRead, line: &mut Vec<u8>, cap: usize) -> std::io::Result<Line> {
    line.clear();
    let mut capped = std::io::Read::take(reader, cap as u64 + 1);
    if capped.read_until(b'\n', line)? == 0 {
        return Ok(Line::End);
    }
    Ok(if line.len() > cap && line.last() != Some(&b'\n') {
        Line::TooLong
    } else {
        Line::Read
    })
}

/// Reads past the rest of the current line.
fn skip_line(reader: &mut dyn BufRead) -> std::io::Result<()> {
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                reader.consume(i + 1);
                return Ok(());
            }
            None => {
                let all = buf.len();
                reader.consume(all);
            }
        }
    }
}

/// A stream that fails after `lines` complete lines (decoders read ahead, so the damage may
/// lie further on).
fn unreadable(input: &Input, lines: u64, op: &'static str, e: &std::io::Error) -> PrepareError {
    PrepareError::Unreadable {
        path: input.path.clone(),
        at: if lines == 0 {
            "at the start".into()
        } else {
            format!("after line {lines}")
        },
        op,
        problem: e
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    }
}

fn bad_line(input: &Input, line: u64, problem: String) -> PrepareError {
    PrepareError::Line {
        path: input.path.clone(),
        line,
        problem,
    }
}

/// The keys of a line's object in their order, for the message about a missing field.
fn keys(line: &[u8]) -> String {
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Vec<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Vec<String>, M::Error> {
            let mut keys = Vec::new();
            while let Some(k) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                keys.push(k);
            }
            Ok(keys)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(line);
    let names: Vec<String> = serde::Deserializer::deserialize_map(&mut de, Keys)
        .unwrap_or_default()
        .iter()
        .take(12)
        .map(|k| format!("{k:?}"))
        .collect();
    if names.is_empty() {
        "the object is empty".into()
    } else {
        format!("its keys: {}", names.join(", "))
    }
}

/// The parser's complaint about one line, placed in that line: serde's own "at line L column
/// C" counts from the line's start, and its line 2 is past the newline, the line's end.
fn json_problem(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let what = text.split(" at line ").next().unwrap_or(&text);
    if e.line() > 1 {
        format!("{what} at the end of the line")
    } else {
        format!("{what} at column {}", e.column())
    }
}

/// The field's text in one line of JSON; an error when the line is not a JSON object.
fn text_of(line: &[u8], field: &str) -> Result<Found, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(line);
    let found = Object(field).deserialize(&mut de)?;
    de.end()?;
    Ok(found)
}

/// Deserializes an object, keeping only `field`'s value.
struct Object<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for Object<'_> {
    type Value = Found;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Object<'_> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Found, M::Error> {
        let mut found = Found::Not("missing");
        while let Some(is_field) = map.next_key_seed(Key(self.0))? {
            if is_field {
                found = map.next_value_seed(Value)?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// A key, compared with the field without copying it.
struct Key<'f>(&'f str);

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = bool;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E>(self, v: &str) -> Result<bool, E> {
        Ok(v == self.0)
    }
}

/// A value: a string's text, or the name of its JSON type.
struct Value;

impl<'de> DeserializeSeed<'de> for Value {
    type Value = Found;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Value {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E>(self, v: &str) -> Result<Found, E> {
        Ok(Found::Text(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Found, E> {
        Ok(Found::Text(v))
    }
    fn visit_unit<E>(self) -> Result<Found, E> {
        Ok(Found::Not("null"))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Found, E> {
        Ok(Found::Not("a boolean"))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Found, E> {
        Ok(Found::Not("a number"))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Found, E> {
        Ok(Found::Not("a number"))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Found, E> {
        Ok(Found::Not("a number"))
    }
    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Found, S::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Found::Not("an array"))
    }
    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Found, M::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Found::Not("an object"))
    }
}

/// Reads everything from a reader (for tests of the decoders).
#[cfg(test)]
fn lines_of(r: impl std::io::Read) -> Vec<String> {
    BufReader::new(r).lines().map(Result::unwrap).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_lines_problem_is_placed_in_that_line() {
        let e = text_of(b"{\"text\": \"unterminated\n", "text").unwrap_err();
        let p = json_problem(&e);
        assert!(
            p.ends_with("at the end of the line") && !p.contains("line 2"),
            "{p}"
        );
        let e = text_of(b"{\"text\": \"a\",}\n", "text").unwrap_err();
        assert!(
            json_problem(&e).ends_with("trailing comma at column 14"),
            "{}",
            json_problem(&e)
        );
    }

    /// A line of exactly the cap (its newline besides) is read whole; one byte more is too
    /// long, and the next line is read after skipping its rest.
    #[test]
    fn lines_up_to_the_cap_are_read_and_longer_ones_cut() {
        let mut reader: &[u8] = b"abcd\nabcde\nxy\nabcdefghij";
        let mut line = Vec::new();
        let mut next = |reader: &mut &[u8]| {
            let how = next_line(reader, &mut line, 4).unwrap();
            (how, String::from_utf8(line.clone()).unwrap())
        };
        assert_eq!(next(&mut reader), (Line::Read, "abcd\n".into()));
        assert_eq!(next(&mut reader), (Line::TooLong, "abcde".into()));
        skip_line(&mut reader).unwrap();
        assert_eq!(next(&mut reader), (Line::Read, "xy\n".into()));
        assert_eq!(next(&mut reader), (Line::TooLong, "abcde".into()));
        skip_line(&mut reader).unwrap();
        assert_eq!(next(&mut reader).0, Line::End);
    }

    #[test]
    fn only_the_field_is_taken() {
        let t = |line: &str| text_of(line.as_bytes(), "text");
        assert_eq!(
            t(r#"{"id": 3, "meta": {"a": [1, {"text": 2}]}, "text": "h\u00e9 \"x\"\n"}"#).unwrap(),
            Found::Text("hé \"x\"\n".into())
        );
        assert_eq!(t(r#"{"id": 3}"#).unwrap(), Found::Not("missing"));
        assert_eq!(t(r#"{"text": null}"#).unwrap(), Found::Not("null"));
        assert_eq!(t(r#"{"text": [1]}"#).unwrap(), Found::Not("an array"));
        assert_eq!(
            t(r#"{"text": "a", "text": "b"}"#).unwrap(),
            Found::Text("b".into())
        );
        assert!(t(r#"["text"]"#).is_err());
        assert!(t(r#"{"text": "a"} x"#).is_err());
        assert!(t(r#"{"text": "a"#).is_err());
        assert!(keys(br#"{"id": 1, "content": "x"}"#).contains(r#""id", "content""#));
    }

    #[test]
    fn decoders_read_what_their_tools_write() {
        use std::io::Write;
        let text = b"{\"text\": \"a\"}\n{\"text\": \"b\"}\n";
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(text).unwrap();
        let gz = gz.finish().unwrap();
        let lines = lines_of(flate2::bufread::MultiGzDecoder::new(&gz[..]));
        assert_eq!(lines.len(), 2);
        let zst = zstd::encode_all(&text[..], 3).unwrap();
        let lines = lines_of(zstd::Decoder::with_buffer(&zst[..]).unwrap());
        assert_eq!(lines.len(), 2);
    }
}
