//! Walking raw JSON by structure alone: the members of an object and the elements of an array,
//! as byte ranges, without decoding the values in them.
//!
//! `GET /pods` only needs to find `status.conditions` in each cached pod, but serde_json's
//! `RawValue` validates every byte of every value it skips; that was three quarters of the
//! handler's instructions (callgrind, 100 pods of 5.5 KB). The store has already parsed each
//! object whole when it was written (`ObjectIndex::from_raw`), so here a value is skipped by
//! its brackets and string quotes only. Input that is not JSON still gives an error, never a
//! panic (every index is checked), and nesting depth costs no stack.

use std::ops::Range;

/// The input is not the JSON the caller expected here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed JSON near byte {at}: expected {expected}")]
pub struct Malformed {
    pub at: usize,
    pub expected: &'static str,
}

fn malformed(at: usize, expected: &'static str) -> Malformed {
    Malformed { at, expected }
}

/// One member of an object: the key's bytes between its quotes, and the value's range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    key: Range<usize>,
    escaped: bool,
    pub value: Range<usize>,
}

impl Member {
    /// Whether the key is `name`; a key with escapes is decoded first.
    pub fn key_is(&self, json: &str, name: &str) -> bool {
        if !self.escaped {
            return json.get(self.key.clone()) == Some(name);
        }
        json.get(self.key.start - 1..self.key.end + 1)
            .and_then(|quoted| serde_json::from_str::<String>(quoted).ok())
            .is_some_and(|k| k == name)
    }
}

/// An object's members in document order, and the position of its closing brace.
pub struct Object {
    pub members: Vec<Member>,
    pub close: usize,
}

impl Object {
    pub fn get(&self, json: &str, name: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.key_is(json, name))
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

fn expect(b: &[u8], i: usize, c: u8, what: &'static str) -> Result<usize, Malformed> {
    match b.get(i) {
        Some(&x) if x == c => Ok(i + 1),
        _ => Err(malformed(i, what)),
    }
}

/// `b[i]` is an opening quote; the position after the closing one, and whether it had escapes.
fn skip_string(b: &[u8], mut i: usize) -> Result<(usize, bool), Malformed> {
    let start = i;
    i += 1;
    let mut escaped = false;
    loop {
        // Most of a pod's bytes are string contents: jump to the next quote or backslash.
        let Some(at) = b
            .get(i..)
            .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
        else {
            return Err(malformed(start, "a closed string"));
        };
        i += at;
        // In bounds: memchr2 found a byte at `at` in `b[i..]`.
        if b[i] == b'"' {
            return Ok((i + 1, escaped));
        }
        escaped = true;
        i += 2;
    }
}

/// The end of the value that starts at `i` (no leading whitespace).
fn skip_value(b: &[u8], i: usize) -> Result<usize, Malformed> {
    match b.get(i) {
        Some(b'"') => Ok(skip_string(b, i)?.0),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j) {
                    None => return Err(malformed(i, "a closed object or array")),
                    Some(b'"') => {
                        j = skip_string(b, j)?.0;
                        continue;
                    }
                    Some(b'{' | b'[') => depth += 1,
                    Some(b'}' | b']') => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok(j + 1);
                        }
                    }
                    Some(_) => {}
                }
                j += 1;
            }
        }
        Some(_) => {
            // A number, true, false or null: up to the next delimiter.
            let mut j = i;
            while let Some(c) = b.get(j) {
                if matches!(c, b',' | b'}' | b']' | b':' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            if j == i {
                Err(malformed(i, "a value"))
            } else {
                Ok(j)
            }
        }
        None => Err(malformed(i, "a value")),
    }
}

/// The members of the object that makes up all of `json` (whitespace around it allowed).
pub fn object(json: &str) -> Result<Object, Malformed> {
    let b = json.as_bytes();
    let mut i = expect(b, skip_ws(b, 0), b'{', "an object")?;
    let mut members = Vec::new();
    i = skip_ws(b, i);
    if b.get(i) == Some(&b'}') {
        return whole(b, i, Object { members, close: i });
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return Err(malformed(i, "a member's key"));
        }
        let (key_end, escaped) = skip_string(b, i)?;
        let key = i + 1..key_end - 1;
        i = expect(b, skip_ws(b, key_end), b':', "':' after a key")?;
        let start = skip_ws(b, i);
        let end = skip_value(b, start)?;
        members.push(Member {
            key,
            escaped,
            value: start..end,
        });
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return whole(b, i, Object { members, close: i }),
            _ => return Err(malformed(i, "',' or '}'")),
        }
    }
}

/// The ranges of the elements of the array that makes up all of `json`.
pub fn array(json: &str) -> Result<Vec<Range<usize>>, Malformed> {
    let b = json.as_bytes();
    let mut i = expect(b, skip_ws(b, 0), b'[', "an array")?;
    let mut out = Vec::new();
    i = skip_ws(b, i);
    if b.get(i) == Some(&b']') {
        return whole(b, i, out);
    }
    loop {
        let end = skip_value(b, i)?;
        out.push(i..end);
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b']') => return whole(b, i, out),
            _ => return Err(malformed(i, "',' or ']'")),
        }
    }
}

/// `close` is the last bracket of the document: only whitespace may follow it.
fn whole<T>(b: &[u8], close: usize, value: T) -> Result<T, Malformed> {
    let after = skip_ws(b, close + 1);
    if after == b.len() {
        Ok(value)
    } else {
        Err(malformed(after, "the end of the document"))
    }
}

/// Whether `value` (raw JSON) is the string `want`; `null` is no string and no match.
pub fn is_string(value: &str, want: &str) -> Result<bool, Malformed> {
    let b = value.as_bytes();
    match b.first() {
        Some(b'"') => {
            let (end, escaped) = skip_string(b, 0)?;
            if end != b.len() {
                return Err(malformed(end, "the end of the string"));
            }
            if !escaped {
                return Ok(value.get(1..end - 1) == Some(want));
            }
            serde_json::from_str::<String>(value)
                .map(|s| s == want)
                .map_err(|_| malformed(0, "a string"))
        }
        _ if value == "null" => Ok(false),
        _ => Err(malformed(0, "a string or null")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys_and_values(json: &str) -> Vec<(String, String)> {
        let o = object(json).unwrap();
        o.members
            .iter()
            .map(|m| {
                let k: String =
                    serde_json::from_str(&json[m.key.start - 1..m.key.end + 1]).unwrap();
                (k, json[m.value.clone()].to_string())
            })
            .collect()
    }

    #[test]
    fn members_are_found_in_order_with_their_raw_values() {
        let json =
            r#" { "a" : 1 , "b":{"x":[1,{"y":"}"}]}, "c":"q\"}" ,"d":null,"e":-1.5e3,"f":[]} "#;
        assert_eq!(
            keys_and_values(json),
            [
                ("a", "1"),
                ("b", r#"{"x":[1,{"y":"}"}]}"#),
                ("c", r#""q\"}""#),
                ("d", "null"),
                ("e", "-1.5e3"),
                ("f", "[]"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        assert_eq!(object(json).unwrap().close, json.trim_end().len() - 1);
    }

    #[test]
    fn escaped_keys_are_compared_decoded() {
        let json = r#"{"st\u0061tus":1,"plain":2}"#;
        let o = object(json).unwrap();
        assert!(o.get(json, "status").is_some());
        assert!(o.get(json, "plain").is_some());
        assert!(o.get(json, "stat").is_none());
    }

    #[test]
    fn agrees_with_serde_json_on_the_recorded_pods() {
        let text = include_str!("../../tests/fixtures/apiserver/pods_list_node.json");
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        for item in v["response"]["body"]["items"].as_array().unwrap() {
            for raw in [
                serde_json::to_string(item).unwrap(),
                serde_json::to_string_pretty(item).unwrap(),
            ] {
                let got = keys_and_values(&raw);
                let want: Vec<(String, serde_json::Value)> = item
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                assert_eq!(got.len(), want.len());
                for ((gk, gv), (wk, wv)) in got.iter().zip(&want) {
                    assert_eq!(gk, wk);
                    assert_eq!(&serde_json::from_str::<serde_json::Value>(gv).unwrap(), wv);
                }
            }
        }
    }

    #[test]
    fn arrays() {
        let json = r#"[ {"a":"]"}, 2 ,"x",[[]]]"#;
        let els: Vec<&str> = array(json).unwrap().into_iter().map(|r| &json[r]).collect();
        assert_eq!(els, [r#"{"a":"]"}"#, "2", r#""x""#, "[[]]"]);
        assert!(array("[]").unwrap().is_empty());
        assert!(array(" [ ] ").unwrap().is_empty());
    }

    #[test]
    fn strings() {
        assert!(is_string(r#""Ready""#, "Ready").unwrap());
        assert!(!is_string(r#""Ready""#, "Read").unwrap());
        assert!(is_string(r#""Re\u0061dy""#, "Ready").unwrap());
        assert!(!is_string("null", "Ready").unwrap());
        assert!(is_string("5", "Ready").is_err());
        assert!(is_string(r#""a"b""#, "a").is_err());
    }

    #[test]
    fn not_json_is_an_error_never_a_panic() {
        for bad in [
            "",
            " ",
            "{",
            "}",
            "[",
            "{\"a\"",
            "{\"a\":",
            "{\"a\":1",
            "{\"a\":1,",
            "{\"a\" 1}",
            "{1:2}",
            "{\"a\":1}x",
            "{\"a\":\"\\",
            "{\"a\":\"x",
            "{\"a\":[1,2}",
            "[1 2]",
            "[1,",
            "{\"a\":}",
            "\"\\",
        ] {
            assert!(object(bad).is_err(), "object {bad:?}");
            assert!(array(bad).is_err(), "array {bad:?}");
            let _ = is_string(bad, "a");
        }
        // Deep nesting is walked without recursion.
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(object(&deep).unwrap().members.len(), 1);
    }
}
