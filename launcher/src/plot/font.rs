//! The charts' font: a TTF file read at run time (plotters' `ab_glyph` text, so no
//! fontconfig or freetype), from `$ZRUN_FONT` or a few standard paths.

use std::path::{Path, PathBuf};

use plotters::style::{register_font, FontStyle};

use crate::launch::BadInput;

/// Where Debian/Ubuntu (fonts-dejavu-core, fonts-liberation), Fedora and Arch keep a sans font.
const CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
];

/// The font file to use: `$ZRUN_FONT` when set, else the first candidate that exists.
pub fn find(env: Option<PathBuf>, candidates: &[&str]) -> anyhow::Result<PathBuf> {
    if let Some(p) = env {
        return if p.is_file() {
            Ok(p)
        } else {
            Err(BadInput(format!(
                "ZRUN_FONT={} is not a file; point it at a .ttf font",
                p.display()
            ))
            .into())
        };
    }
    candidates.iter().map(PathBuf::from).find(|p| p.is_file()).ok_or_else(|| {
        anyhow::anyhow!(
            "no font for the charts (looked for {}); install one (apt-get install fonts-dejavu-core) or set ZRUN_FONT=/path/to/font.ttf",
            candidates[0]
        )
    })
}

/// Reads the font and registers it as every family the charts name. Once per process: the
/// bytes live as long as plotters' font table.
pub fn register() -> anyhow::Result<PathBuf> {
    let path = find(std::env::var_os("ZRUN_FONT").map(PathBuf::from), CANDIDATES)?;
    let bytes = std::fs::read(&path)
        .map_err(|e| BadInput(format!("cannot read font {}: {e}", path.display())))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    for family in ["sans-serif", "serif", "monospace"] {
        register_font(family, FontStyle::Normal, bytes).map_err(|_| bad_font(&path))?;
    }
    Ok(path)
}

fn bad_font(path: &Path) -> anyhow::Error {
    BadInput(format!(
        "{} is not a TrueType/OpenType font; set ZRUN_FONT to a .ttf file",
        path.display()
    ))
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_wins_and_must_exist() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let got = find(Some(f.path().into()), &["/nonexistent"]).unwrap();
        assert_eq!(got, f.path());
        let e = find(Some("/nonexistent/x.ttf".into()), CANDIDATES).unwrap_err();
        assert!(
            e.to_string().contains("ZRUN_FONT=/nonexistent/x.ttf"),
            "{e}"
        );
    }

    #[test]
    fn no_font_names_the_fix() {
        let e = find(None, &["/nonexistent/a.ttf", "/nonexistent/b.ttf"]).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("apt-get install fonts-dejavu-core") && msg.contains("ZRUN_FONT"),
            "{msg}"
        );
        assert!(!msg.contains('\n'));
        let f = tempfile::NamedTempFile::new().unwrap();
        let p = f.path().to_str().unwrap();
        assert_eq!(find(None, &["/nonexistent/a.ttf", p]).unwrap(), f.path());
    }
}
