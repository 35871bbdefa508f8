//! Horizon: train LLMs whose state is far larger than accelerator memory. Library half of the
//! `horizon` binary (the binary is `src/main.rs`).
//!
//! The modules are layers, and every import points down (`layering` keeps it so):
//! `run` (the verbs and what they share) -> `sim` (the model of a machine) -> `engine` (the step
//! as a plan, and its executor) -> `store` (the host state) -> `optim` -> `model` -> `data`,
//! `adapter` -> `hf`, `tokenizer`, `rng` -> `hash`, and the backend crate below them all.

pub mod adapter;
pub mod data;
pub mod engine;
pub mod hash;
pub mod hf;
pub mod model;
pub mod optim;
pub mod rng;
pub mod run;
pub mod sim;
pub mod store;
pub mod tokenizer;

/// The layering, kept: a file of one top-level module imports (`crate::...`, comments aside)
/// only from modules on a lower layer. A file under `engine/`, `model/`, `optim/`, `data/` or
/// `store.rs` naming the run layer fails here, and so does any cycle between two modules.
#[cfg(test)]
mod layering {
    use std::path::{Path, PathBuf};

    /// The layer of a top-level module. Siblings on one layer (model, data, adapter) import
    /// none of each other.
    fn layer(module: &str) -> usize {
        match module {
            "run" => 7,
            "sim" => 6,
            "engine" => 5,
            "store" => 4,
            "optim" => 3,
            "model" | "data" | "adapter" => 2,
            "hf" | "tokenizer" | "rng" => 1,
            "hash" => 0,
            other => panic!(
                "src/{other}: a new top-level module needs its layer in `layering::layer` (and a \
                 line in ARCHITECTURE.md's code map)"
            ),
        }
    }

    /// `code` without its comments (line comments, doc comments included, and block comments).
    fn strip_comments(code: &str) -> String {
        let mut out = String::with_capacity(code.len());
        let mut rest = code;
        while let Some(i) = rest.find('/') {
            out.push_str(&rest[..i]);
            let tail = &rest[i..];
            if tail.starts_with("//") {
                let end = tail.find('\n').unwrap_or(tail.len());
                rest = &tail[end..];
            } else if tail.starts_with("/*") {
                let end = tail.find("*/").map_or(tail.len(), |e| e + 2);
                out.extend(tail[..end].chars().filter(|&c| c == '\n'));
                rest = &tail[end..];
            } else {
                out.push('/');
                rest = &tail[1..];
            }
        }
        out.push_str(rest);
        out
    }

    /// The leading identifier of `s`.
    fn ident(s: &str) -> &str {
        let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
        &s[..end]
    }

    /// The top-level modules `code` names through `crate::` paths (groups `crate::{a, b::c}`
    /// included), each with its 1-based line.
    fn imports(code: &str) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        for (i, _) in code.match_indices("crate::") {
            let line = code[..i].matches('\n').count() + 1;
            let rest = &code[i + "crate::".len()..];
            let Some(group) = rest.strip_prefix('{') else {
                out.push((line, ident(rest).to_string()));
                continue;
            };
            let (mut depth, mut start) = (0usize, 0usize);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push((line, ident(group[start..j].trim_start()).to_string()));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push((line, ident(group[start..j].trim_start()).to_string()));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        }
        out.retain(|(_, m)| !m.is_empty());
        out
    }

    /// Every `.rs` file under `dir`.
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("src/ is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    #[test]
    fn every_import_points_down() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let mut wrong = Vec::new();
        for path in files {
            let rel = path.strip_prefix(&src).expect("under src/");
            let first = rel.components().next().expect("a path").as_os_str().to_string_lossy();
            let module = first.trim_end_matches(".rs").to_string();
            if module == "lib" || module == "main" {
                continue;
            }
            let code = strip_comments(&std::fs::read_to_string(&path).expect("readable"));
            for (line, to) in imports(&code) {
                if to != module && layer(&to) >= layer(&module) {
                    wrong.push(format!("src/{}:{line}: {module} imports {to}", rel.display()));
                }
            }
        }
        assert!(
            wrong.is_empty(),
            "imports that do not point down (run -> sim -> engine -> store -> optim -> model, \
             data, adapter -> hf, tokenizer, rng -> hash):\n{}",
            wrong.join("\n")
        );
    }

    #[test]
    fn the_scan_finds_grouped_and_inline_paths_and_skips_comments() {
        let code = "use crate::{engine::plan::Op, optim::{a, b}};\n// crate::run\n\
                    /// [`crate::sim`]\nlet x = crate::model::describe(c); /* crate::data */";
        let found = imports(&strip_comments(code));
        let names: Vec<(usize, &str)> = found.iter().map(|(l, m)| (*l, m.as_str())).collect();
        assert_eq!(names, [(1, "engine"), (1, "optim"), (4, "model")]);
    }
}

/// ARCHITECTURE.md stays true where a test can tell: every test its invariants name as
/// `path/to/file.rs::...::name` exists in that file.
#[cfg(test)]
mod architecture_md {
    #[test]
    fn every_test_it_names_exists() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
        let (mut missing, mut named) = (Vec::new(), 0);
        let token = |c: char| c == '`' || c == ',' || c == '(' || c == ')' || c.is_whitespace();
        for quoted in doc.split(token).filter(|t| t.starts_with(['s', 't', 'c'])) {
            let Some((path, item)) = quoted.split_once(".rs::") else { continue };
            let name = item.rsplit("::").next().unwrap_or(item);
            let file = format!("{path}.rs");
            let found = std::fs::read_to_string(root.join(&file)).is_ok_and(|code| {
                code.contains(&format!("fn {name}(")) || code.contains(&format!("mod {name} "))
            });
            named += 1;
            if !found {
                missing.push(format!("{file}::{item}"));
            }
        }
        assert!(named > 30, "only {named} tests named: the scan lost them");
        assert!(missing.is_empty(), "ARCHITECTURE.md names tests that do not exist:\n{missing:#?}");
    }
}
