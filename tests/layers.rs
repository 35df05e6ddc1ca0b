//! The layering of docs/architecture.md, enforced: a module imports only from its own layer
//! or the layers below, and no two modules import each other, directly or round a circle;
//! nor do two files of one module (`crate::`, `super::` and `self::` paths resolved to files).
//!
//! It reads the layer table from docs/architecture.md (so the document and the check cannot
//! drift) and every `crate::<module>` path outside comments in src/ (a module's `tests.rs`
//! files count as the module's: a test that needs a layer above is a test in the wrong place).
//! A check over paths rather than crates: a workspace of crates would make the compiler
//! enforce it, but would split one small binary's build into many, and the paths say the same.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Imports that point up and are still to go, each with why it is still there. The check fails
/// when one of these is no longer needed, so the list only shrinks.
const KNOWN_UPWARD: &[(&str, &str, &str)] = &[];

/// Layer number by module, from the table in docs/architecture.md.
fn layers() -> BTreeMap<String, usize> {
    let doc = std::fs::read_to_string(Path::new(ROOT).join("docs/architecture.md"))
        .expect("docs/architecture.md holds the layer table");
    let start = doc
        .find("<!-- layers -->")
        .expect("docs/architecture.md marks its layer table with <!-- layers -->");
    let end = doc[start..]
        .find("<!-- /layers -->")
        .map(|e| start + e)
        .expect("the layer table ends with <!-- /layers -->");
    let mut out = BTreeMap::new();
    for line in doc[start..end].lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | n | name | `a`, `b` | what |
        if cells.len() < 5 {
            continue;
        }
        let Ok(n) = cells[1].parse::<usize>() else {
            continue;
        };
        for m in cells[3].split(',') {
            let m = m.trim().trim_matches('`');
            if !m.is_empty() {
                assert!(
                    out.insert(m.to_string(), n).is_none(),
                    "module {m} is in two layers of docs/architecture.md"
                );
            }
        }
    }
    assert!(
        !out.is_empty(),
        "no layer rows found in docs/architecture.md"
    );
    out
}

/// The top-level modules src/lib.rs declares.
fn declared_modules() -> BTreeSet<String> {
    let lib = std::fs::read_to_string(Path::new(ROOT).join("src/lib.rs")).unwrap();
    lib.lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|m| m.trim_end_matches(';').trim().to_string())
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module a file of src/ belongs to: `src/pod/start.rs` and `src/pod.rs` are `pod`.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let m = first.strip_suffix(".rs").unwrap_or(first);
    (m != "lib" && m != "main").then(|| m.to_string())
}

/// The modules a piece of code names through `crate::`, outside comments and string
/// literals, each with the byte offset where it is named (a `use crate::{...}` list that
/// rustfmt broke over lines is read whole).
fn named_at(text: &str) -> Vec<(String, usize)> {
    let code: String = text
        .lines()
        .map(strip_comment_and_strings)
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = code[from..].find("crate::").map(|i| from + i) {
        let after = &code[i + "crate::".len()..];
        from = i + "crate::".len();
        // a `crate::` that is the tail of a longer path (`edgehub_crate::`) is not ours
        if code[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        if let Some(group) = after.strip_prefix('{') {
            // use crate::{a, b::c, d::{e}}: the first segment of each item at depth 0
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.extend(first_segment(&item).map(|m| (m, i)));
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            out.extend(first_segment(&item).map(|m| (m, i)));
        } else {
            out.extend(first_segment(after).map(|m| (m, i)));
        }
    }
    // offsets in `code` are offsets in `text` line for line, since each line only got shorter
    // at its end; count lines in `code`
    out.into_iter()
        .map(|(m, at)| (m, code[..at].matches('\n').count() + 1))
        .collect()
}

/// The modules one line names (for the reader's own test).
fn named(line: &str) -> Vec<String> {
    named_at(line).into_iter().map(|(m, _)| m).collect()
}

fn first_segment(s: &str) -> Option<String> {
    let s = s.trim();
    let seg: String = s
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!seg.is_empty() && seg != "self").then_some(seg)
}

fn strip_comment_and_strings(line: &str) -> String {
    let mut out = String::new();
    let mut in_str = false;
    let mut prev = '\0';
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if in_str {
            if c == '"' && prev != '\\' {
                in_str = false;
            }
            prev = if prev == '\\' && c == '\\' { '\0' } else { c };
            continue;
        }
        if c == '/' && chars.peek() == Some(&'/') {
            break;
        }
        // a char literal holding a quote (`'"'`, `'\"'`) opens no string
        if c == '\'' {
            let ahead: String = chars.clone().take(3).collect();
            if ahead.starts_with("\"'") || ahead.starts_with("\\\"'") {
                let skip = if ahead.starts_with('"') { 2 } else { 3 };
                for _ in 0..skip {
                    chars.next();
                }
                continue;
            }
        }
        if c == '"' {
            in_str = true;
            prev = '\0';
            continue;
        }
        out.push(c);
    }
    out
}

/// module -> module it imports -> where (file:line).
fn imports() -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let src = Path::new(ROOT).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut out: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for f in files {
        let Some(m) = module_of(&src, &f) else {
            continue;
        };
        let text = std::fs::read_to_string(&f).unwrap();
        let rel = f.strip_prefix(ROOT).unwrap().display().to_string();
        for (to, line) in named_at(&text) {
            if to != m {
                out.entry(m.clone())
                    .or_default()
                    .entry(to)
                    .or_default()
                    .push(format!("{rel}:{line}"));
            }
        }
    }
    out
}

#[test]
fn every_module_is_in_exactly_one_layer() {
    let layers = layers();
    let declared = declared_modules();
    let missing: Vec<_> = declared
        .iter()
        .filter(|m| !layers.contains_key(*m))
        .collect();
    let stale: Vec<_> = layers.keys().filter(|m| !declared.contains(*m)).collect();
    assert!(
        missing.is_empty(),
        "src/lib.rs declares modules docs/architecture.md's layer table does not place: {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "docs/architecture.md places modules src/lib.rs does not declare: {stale:?}"
    );
}

#[test]
fn imports_point_down_or_sideways_and_the_known_upward_ones_are_still_needed() {
    let layers = layers();
    let mut wrong = Vec::new();
    let mut seen_known = BTreeSet::new();
    for (from, tos) in imports() {
        let Some(&lf) = layers.get(&from) else {
            continue;
        };
        for (to, at) in tos {
            let Some(&lt) = layers.get(&to) else {
                continue; // not a module of ours (a macro, `crate::VERSION`)
            };
            if lt <= lf {
                continue;
            }
            if KNOWN_UPWARD.iter().any(|(f, t, _)| *f == from && *t == to) {
                seen_known.insert((from.clone(), to.clone()));
                continue;
            }
            wrong.push(format!(
                "{from} (layer {lf}) imports {to} (layer {lt}) at {}",
                at.join(", ")
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that point up a layer (docs/architecture.md says which way they go):\n{}",
        wrong.join("\n")
    );
    let gone: Vec<_> = KNOWN_UPWARD
        .iter()
        .filter(|(f, t, _)| !seen_known.contains(&(f.to_string(), t.to_string())))
        .map(|(f, t, why)| format!("{f} -> {t} ({why})"))
        .collect();
    assert!(
        gone.is_empty(),
        "these known upward imports are gone: take them off KNOWN_UPWARD:\n{}",
        gone.join("\n")
    );
}

#[test]
fn no_two_modules_import_each_other_round_a_circle() {
    // The known upward imports close circles through `config` (config composes outbox's and
    // upgrade's sections, which import what imports config); they are counted above, so the
    // search leaves them out and finds every other circle.
    let mut graph = imports();
    for (from, to, _) in KNOWN_UPWARD {
        if let Some(tos) = graph.get_mut(*from) {
            tos.remove(*to);
        }
    }
    let layers = layers();
    // Depth-first search for a back edge, over modules of ours only.
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeMap<String, Vec<String>>>,
        layers: &BTreeMap<String, usize>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<String>,
    ) {
        if done.contains(m) {
            return;
        }
        if let Some(i) = stack.iter().position(|s| s == m) {
            let mut circle = stack[i..].to_vec();
            circle.push(m.to_string());
            let edges: Vec<String> = circle
                .windows(2)
                .map(|w| {
                    let at = graph
                        .get(&w[0])
                        .and_then(|t| t.get(&w[1]))
                        .and_then(|a| a.first())
                        .cloned()
                        .unwrap_or_default();
                    format!("{} -> {} ({at})", w[0], w[1])
                })
                .collect();
            found.push(edges.join(", "));
            return;
        }
        stack.push(m.to_string());
        if let Some(tos) = graph.get(m) {
            for to in tos.keys().filter(|t| layers.contains_key(*t)) {
                visit(to, graph, layers, stack, done, found);
            }
        }
        stack.pop();
        done.insert(m.to_string());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for m in layers.keys() {
        visit(m, &graph, &layers, &mut Vec::new(), &mut done, &mut found);
    }
    assert!(
        found.is_empty(),
        "modules that import each other:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_reader_sees_imports_the_way_the_compiler_does() {
    assert_eq!(named("use crate::pod::observe::Observer;"), ["pod"]);
    assert_eq!(
        named("use crate::{names, pod::{desired, Holder}, store::Store};"),
        ["names", "pod", "store"]
    );
    assert_eq!(
        named("let x = crate::time::boot_ms(); // crate::api"),
        ["time"]
    );
    assert!(named("/// see [`crate::runtime`]").is_empty());
    assert!(named(r#"let s = "crate::runtime";"#).is_empty());
    assert!(named("use edgehub_crate::thing;").is_empty());
    // a quote in a char literal does not hide the rest of the line
    assert_eq!(named("k.replace('\"', \"\"); crate::names::x()"), ["names"]);
    assert_eq!(named("if b == b'\\\"' { crate::time::now() }"), ["time"]);
    let broken = "use crate::{\n    cri::api,\n    // crate::upgrade\n    store::Store,\n};\nfn f() { crate::time::now() }";
    assert_eq!(
        named_at(broken),
        [
            ("cri".to_string(), 1),
            ("store".to_string(), 1),
            ("time".to_string(), 6)
        ]
    );
}

/// The module path of each file of the library: `src/controller/run.rs` is
/// `controller::run`, `src/podspec.rs` and `src/podspec/mod.rs` are `podspec`, and a file a
/// `#[path = "..."] mod name;` brings in is the module that declaration names.
fn file_modules() -> BTreeMap<PathBuf, Vec<String>> {
    let src = Path::new(ROOT).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut out = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let mut segs: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_str().unwrap().to_string())
            .collect();
        let last = segs.pop().unwrap();
        match last.as_str() {
            "mod.rs" => {}
            "lib.rs" if segs.is_empty() => continue,
            _ => segs.push(last.trim_end_matches(".rs").to_string()),
        }
        // The binary's files: `crate::` there is the binary, not the library.
        if segs.first().is_some_and(|s| s == "main") {
            continue;
        }
        out.insert(f.clone(), segs);
    }
    // `#[path]` declarations move a file to the module that declares it.
    for f in &files {
        let Some(m) = out.get(f).cloned() else {
            continue;
        };
        let text = std::fs::read_to_string(f).unwrap();
        let mut lines = text.lines().map(str::trim);
        while let Some(l) = lines.next() {
            let Some(p) = l
                .strip_prefix("#[path = \"")
                .and_then(|p| p.strip_suffix("\"]"))
            else {
                continue;
            };
            let Some(name) = lines.next().and_then(|n| {
                n.split_whitespace()
                    .skip_while(|w| *w != "mod")
                    .nth(1)
                    .map(|n| n.trim_end_matches(';').to_string())
            }) else {
                continue;
            };
            let target = f.parent().unwrap().join(p);
            if out.contains_key(&target) {
                let mut path = m.clone();
                path.push(name);
                out.insert(target, path);
            }
        }
    }
    out
}

/// The paths a piece of code names that start with `crate::`, `super::` or `self::`, each
/// as its segments (a `use` group gives one path per item) with its line.
fn paths_at(text: &str) -> Vec<(Vec<String>, usize)> {
    let code: String = text
        .lines()
        .map(strip_comment_and_strings)
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    // The segments of `a::b::c` at the start of `s`, stopping at a group or anything else.
    fn segments(s: &str, ident: &dyn Fn(&str) -> String) -> (Vec<String>, usize) {
        let mut segs = Vec::new();
        let mut at = 0;
        loop {
            let rest = s[at..].trim_start();
            at = s.len() - rest.len();
            let id = ident(rest);
            if id.is_empty() {
                break;
            }
            segs.push(id.clone());
            at += id.len();
            match s[at..].strip_prefix("::") {
                Some(_) => at += 2,
                None => break,
            }
        }
        (segs, at)
    }
    let mut out = Vec::new();
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    for lead in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(lead).map(|i| from + i) {
            from = i + lead.len();
            if code[..i]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':' || c == '$')
            {
                continue;
            }
            let (segs, end) = segments(&code[i..], &ident);
            let after = &code[i + end..];
            if let Some(group) = after.strip_prefix('{') {
                let mut depth = 0;
                let mut item = String::new();
                let mut items = Vec::new();
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            items.push(std::mem::take(&mut item));
                            continue;
                        }
                        _ => {}
                    }
                    item.push(c);
                }
                items.push(item);
                for it in items {
                    let (more, _) = segments(&it, &ident);
                    let mut p = segs.clone();
                    p.extend(more.into_iter().filter(|s| s != "self"));
                    out.push((p, line_of(i)));
                }
            } else {
                out.push((segs, line_of(i)));
            }
        }
    }
    out
}

/// Resolves `segs` (starting with `crate`, `super` or `self`) named in module `from` to the
/// longest module path that is a file of ours.
fn resolve(from: &[String], segs: &[String], known: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    let mut base: Vec<String>;
    let mut rest = segs;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base = Vec::new();
            rest = &rest[1..];
        }
        Some("self") => {
            base = from.to_vec();
            rest = &rest[1..];
        }
        Some("super") => {
            base = from.to_vec();
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    base.extend(rest.iter().cloned());
    (1..=base.len())
        .rev()
        .map(|n| base[..n].to_vec())
        .find(|p| known.contains(p))
}

/// file module -> file module it names -> where (file:line); a module naming its own
/// ancestors (`use super::*`) or descendants (`mod x; pub use x::y;`) is structure, not an
/// import between files, and is left out.
fn file_imports() -> BTreeMap<Vec<String>, BTreeMap<Vec<String>, Vec<String>>> {
    let files = file_modules();
    let known: BTreeSet<Vec<String>> = files.values().cloned().collect();
    let mut out: BTreeMap<Vec<String>, BTreeMap<Vec<String>, Vec<String>>> = BTreeMap::new();
    for (f, m) in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let rel = f.strip_prefix(ROOT).unwrap().display().to_string();
        for (segs, line) in paths_at(&text) {
            let Some(to) = resolve(m, &segs, &known) else {
                continue;
            };
            if to.starts_with(m) || m.starts_with(&to) {
                continue;
            }
            out.entry(m.clone())
                .or_default()
                .entry(to)
                .or_default()
                .push(format!("{rel}:{line}"));
        }
    }
    out
}

#[test]
fn no_two_files_of_a_module_import_each_other_round_a_circle() {
    let graph = file_imports();
    fn visit(
        m: &Vec<String>,
        graph: &BTreeMap<Vec<String>, BTreeMap<Vec<String>, Vec<String>>>,
        stack: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
        found: &mut Vec<String>,
    ) {
        if done.contains(m) {
            return;
        }
        if let Some(i) = stack.iter().position(|s| s == m) {
            let mut circle = stack[i..].to_vec();
            circle.push(m.clone());
            let edges: Vec<String> = circle
                .windows(2)
                .map(|w| {
                    let at = graph
                        .get(&w[0])
                        .and_then(|t| t.get(&w[1]))
                        .and_then(|a| a.first())
                        .cloned()
                        .unwrap_or_default();
                    format!("{} -> {} ({at})", w[0].join("::"), w[1].join("::"))
                })
                .collect();
            found.push(edges.join(", "));
            return;
        }
        stack.push(m.clone());
        if let Some(tos) = graph.get(m) {
            for to in tos.keys() {
                visit(to, graph, stack, done, found);
            }
        }
        stack.pop();
        done.insert(m.clone());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        visit(m, &graph, &mut Vec::new(), &mut done, &mut found);
    }
    assert!(
        found.is_empty(),
        "files that import each other (move what both need to where it belongs, so the \
         imports point one way):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_file_reader_resolves_paths_the_way_the_compiler_does() {
    let known: BTreeSet<Vec<String>> = [
        vec!["podspec"],
        vec!["podspec", "env"],
        vec!["podspec", "volumes"],
        vec!["controller"],
        vec!["controller", "approve"],
        vec!["controller", "approve", "watch"],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(String::from).collect())
    .collect();
    let m = |s: &str| -> Vec<String> { s.split("::").map(String::from).collect() };
    let env = m("podspec::env");
    let text = "use super::volumes::{missing_object, pod_ns};\nuse super::*;\n// super::nothing\nfn f() { crate::controller::approve::watch::run() }";
    let got: Vec<_> = paths_at(text)
        .into_iter()
        .filter_map(|(p, line)| resolve(&env, &p, &known).map(|r| (r.join("::"), line)))
        .collect();
    assert_eq!(
        got,
        [
            ("controller::approve::watch".to_string(), 4),
            ("podspec::volumes".to_string(), 1),
            ("podspec::volumes".to_string(), 1),
            ("podspec".to_string(), 2),
        ]
    );
    let watch = m("controller::approve::watch");
    assert_eq!(
        resolve(&watch, &m("super::super::approve::x"), &known),
        Some(m("controller::approve"))
    );
    assert_eq!(
        resolve(&watch, &m("self::inner"), &known),
        Some(watch.clone())
    );
    assert!(paths_at("let x = $crate::y;").is_empty());
}
