//! Repository chores that are code, not shell: `cargo xtask tidy` checks the house rules that
//! rustc and clippy do not (module docs, no debugging leftovers). The same check runs as a test, so
//! `cargo test --workspace` enforces it.

use std::path::{Path, PathBuf};

fn main() -> anyhow::Result<()> {
    let task = std::env::args().nth(1).unwrap_or_default();
    match task.as_str() {
        "tidy" => {
            let problems = tidy(&workspace_root());
            for problem in &problems {
                eprintln!("{problem}");
            }
            anyhow::ensure!(problems.is_empty(), "tidy: {} problem(s)", problems.len());
            println!("tidy: ok");
            Ok(())
        }
        _ => {
            eprintln!("usage: cargo xtask tidy\n\n  tidy   check module docs and leftovers in every Rust file");
            std::process::exit(2);
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_owned()
}

/// Every problem found, one line each, with the file and the rule broken.
fn tidy(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    for top in ["crates", "xtask", "fuzz"] {
        collect_rust_files(&root.join(top), &mut files);
    }
    let mut problems = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            problems.push(format!("{}: not readable as UTF-8", file.display()));
            continue;
        };
        let shown = file.strip_prefix(root).unwrap_or(&file).display().to_string();
        problems.extend(check_file(&shown, &text));
    }
    problems
}

fn collect_rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name == "corpus" || name == "artifacts" {
            continue;
        }
        if path.is_dir() {
            collect_rust_files(&path, files);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            files.push(path);
        }
    }
}

/// The rules for one file. Test files under `tests/` and benches count too: they are read as
/// often as the code.
fn check_file(name: &str, text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let first_code = text.lines().map(str::trim).find(|line| !line.is_empty());
    let documented =
        first_code.is_some_and(|line| line.starts_with("//!") || line.starts_with("#!["));
    if !documented {
        problems
            .push(format!("{name}: the file must open with a `//!` comment saying why it exists"));
    }
    for (index, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        for banned in ["dbg!(", "todo!(", "unimplemented!("] {
            if code.contains(banned) && !is_string_mention(code, banned) {
                problems.push(format!("{name}:{}: `{banned}..)` left in the code", index + 1));
            }
        }
    }
    problems
}

/// True when the banned text only appears inside a string literal (as in this file's own list).
fn is_string_mention(code: &str, banned: &str) -> bool {
    code.match_indices(banned).all(|(at, _)| code[..at].matches('"').count() % 2 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_is_tidy() {
        let problems = tidy(&workspace_root());
        assert!(problems.is_empty(), "tidy found problems:\n{}", problems.join("\n"));
    }

    #[test]
    fn rules_catch_what_they_should() {
        assert_eq!(check_file("a.rs", "//! Why.\nfn f() {}\n"), Vec::<String>::new());
        assert_eq!(check_file("a.rs", "fn f() {}\n").len(), 1);
        assert_eq!(check_file("a.rs", "//! Why.\nfn f() { dbg!(1); }\n").len(), 1);
        assert_eq!(check_file("a.rs", "//! Why.\nfn f() { todo!() }\n").len(), 1);
        assert_eq!(check_file("a.rs", "//! Why.\nconst X: &str = \"todo!(\";\n").len(), 0);
        assert_eq!(check_file("a.rs", "//! Why.\n// dbg!(x) in a comment\n").len(), 0);
    }
}
