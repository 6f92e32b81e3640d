//! Responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory,
//! within a byte budget (the oldest go first), each readable only with the API key that
//! made it. A restart forgets them all.

use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Default budget of the store: a few thousand conversations of a few pages each.
pub const DEFAULT_RESPONSE_STORE_BYTES: usize = 64 << 20;

/// One stored response.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The response object as it was answered (without a capture's fields).
    pub response: Value,
    /// The conversation up to and including this response's output, as chat messages
    /// (without instructions, which a follow-up does not inherit).
    pub conversation: Arc<Vec<Value>>,
    /// This response's own input as Responses items, each with an id.
    pub input_items: Arc<Vec<Value>>,
    /// The API key that made it, on a server with keys.
    owner: Option<String>,
    bytes: usize,
}

#[derive(Default)]
struct Entries {
    by_id: HashMap<String, StoredResponse>,
    /// Ids oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

pub struct ResponseStore {
    max_bytes: usize,
    entries: Mutex<Entries>,
}

impl ResponseStore {
    /// A store of at most `max_bytes` (0 keeps nothing).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            entries: Mutex::new(Entries::default()),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, Entries> {
        // A panic while holding the lock leaves the maps consistent (no update spans
        // two steps that a panic could split), so a poisoned lock is still usable.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps a response, dropping the oldest ones until it fits; one larger than the
    /// whole budget is not kept (`false`).
    pub fn put(
        &self,
        id: &str,
        response: Value,
        conversation: Vec<Value>,
        input_items: Vec<Value>,
        owner: Option<String>,
    ) -> bool {
        let bytes = id.len()
            + response.to_string().len()
            + conversation
                .iter()
                .chain(&input_items)
                .map(|m| m.to_string().len())
                .sum::<usize>();
        if bytes > self.max_bytes {
            return false;
        }
        let mut entries = self.entries();
        while entries.bytes + bytes > self.max_bytes {
            let Some(oldest) = entries.order.pop_front() else {
                break;
            };
            if let Some(gone) = entries.by_id.remove(&oldest) {
                entries.bytes -= gone.bytes;
            }
        }
        let stored = StoredResponse {
            response,
            conversation: Arc::new(conversation),
            input_items: Arc::new(input_items),
            owner,
            bytes,
        };
        if let Some(old) = entries.by_id.insert(id.to_string(), stored) {
            entries.bytes -= old.bytes;
            entries.order.retain(|o| o != id);
        }
        entries.order.push_back(id.to_string());
        entries.bytes += bytes;
        true
    }

    /// The response `id`, if it is kept and `key` may read it.
    pub fn get(&self, id: &str, key: Option<&str>) -> Option<StoredResponse> {
        let entries = self.entries();
        let stored = entries.by_id.get(id)?;
        (stored.owner.as_deref() == key || stored.owner.is_none()).then(|| stored.clone())
    }

    /// Forgets the response `id` if `key` may; whether it was kept.
    pub fn delete(&self, id: &str, key: Option<&str>) -> bool {
        let mut entries = self.entries();
        let readable = entries
            .by_id
            .get(id)
            .is_some_and(|s| s.owner.is_none() || s.owner.as_deref() == key);
        if !readable {
            return false;
        }
        if let Some(gone) = entries.by_id.remove(id) {
            entries.bytes -= gone.bytes;
        }
        entries.order.retain(|o| o != id);
        true
    }

    /// Bytes kept now.
    pub fn bytes(&self) -> usize {
        self.entries().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conversation(text: &str) -> Vec<Value> {
        vec![json!({"role": "user", "content": text})]
    }

    #[test]
    fn the_oldest_go_first_and_keys_keep_their_own() {
        let store = ResponseStore::new(400);
        assert!(store.put(
            "a",
            json!({"id": "a"}),
            conversation(&"x".repeat(100)),
            Vec::new(),
            None
        ));
        assert!(store.put(
            "b",
            json!({"id": "b"}),
            conversation(&"y".repeat(100)),
            Vec::new(),
            Some("k1".into())
        ));
        assert!(store.get("a", None).is_some());
        assert!(store.get("b", None).is_none(), "another key's response");
        assert!(store.get("b", Some("k2")).is_none());
        let b = store.get("b", Some("k1")).expect("its own key reads it");
        assert_eq!(b.conversation[0]["content"], "y".repeat(100));
        // A third fills past the budget: the oldest, `a`, goes.
        assert!(store.put(
            "c",
            json!({"id": "c"}),
            conversation(&"z".repeat(150)),
            Vec::new(),
            None
        ));
        assert!(store.get("a", None).is_none());
        assert!(store.get("c", None).is_some());
        assert!(store.bytes() <= 400);
        // Too large for the whole budget: not kept, nothing dropped for it.
        assert!(!store.put(
            "d",
            json!({}),
            conversation(&"w".repeat(500)),
            Vec::new(),
            None
        ));
        assert!(store.get("c", None).is_some());
        assert!(!store.delete("b", Some("k2")));
        assert!(store.delete("b", Some("k1")));
        assert!(store.get("b", Some("k1")).is_none());
        let empty = ResponseStore::new(0);
        assert!(!empty.put("e", json!({}), Vec::new(), Vec::new(), None));
    }
}
