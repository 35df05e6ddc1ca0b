//! Decoding what the apiserver sends: watch-stream framing and events, object indexing,
//! ControllerRevisions, and the PodNeedUpgrade splice into raw pod JSON.
#![no_main]

use edgehub::kube::watch::{parse_event, Frame, LineFramer, WatchEvent};
use edgehub::object::{Kind, ObjectIndex};
use edgehub::revision::{Need, Revision};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut framer = LineFramer::new(4096);
    let mut frames = framer.push(data);
    frames.extend(framer.push(b"\n"));
    for f in frames {
        if let Frame::Line(l) = f {
            if let WatchEvent::Added(raw) | WatchEvent::Modified(raw) | WatchEvent::Deleted(raw) = parse_event(&l) {
                for kind in Kind::ALL {
                    let _ = ObjectIndex::from_raw(kind, &raw);
                }
                let _ = Revision::from_raw(&raw);
                let _ = edgehub::api::podlist::with_condition(&raw, &Need::NoRevision.condition());
            }
        }
    }
});
