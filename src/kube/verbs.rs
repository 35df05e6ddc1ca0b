//! The requests edgehub makes, one method each: list (paged), watch, get, create, update,
//! patch and delete, over the transport in `client`.

use super::error::KubeError;
use super::resource::{query, Resource};
use super::watch::LineFramer;
use hyper::Method;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::VecDeque;
use std::time::Duration;

use super::client::ApiClient;
use super::stream::WatchStream;

/// Query parameters of a list or watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListParams {
    pub field_selector: Option<String>,
    pub label_selector: Option<String>,
}

/// How long the apiserver's watch cache waits for a resourceVersion it does not have before
/// it answers "too large" (`blockTimeout` in k8s.io/apiserver's watch_cache.go).
const WATCH_CACHE_BLOCK: Duration = Duration::from_secs(3);

/// One page of a list: the raw items and the list's metadata.
#[derive(Debug)]
pub struct ListPage {
    pub resource_version: String,
    pub continue_token: Option<String>,
    /// Raw JSON of each item as the apiserver sent it.
    pub items: Vec<String>,
}

#[derive(Deserialize)]
struct RawList<'a> {
    #[serde(default)]
    metadata: ListMeta,
    #[serde(borrow, default)]
    items: Vec<&'a RawValue>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    #[serde(default)]
    resource_version: String,
    #[serde(default, rename = "continue")]
    continue_token: Option<String>,
}

/// The patch formats the apiserver takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    StrategicMerge,
}

impl PatchType {
    fn content_type(self) -> &'static str {
        match self {
            PatchType::Merge => "application/merge-patch+json",
            PatchType::StrategicMerge => "application/strategic-merge-patch+json",
        }
    }
}

impl ApiClient {
    /// One page of a list. `resource_version` "0" lets the apiserver answer from its cache.
    pub async fn list(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        params: &ListParams,
        limit: Option<u32>,
        continue_token: Option<&str>,
    ) -> Result<ListPage, KubeError> {
        let request = Self::request_desc("list", res, None, namespace, None);
        let limit_s = limit.map(|l| l.to_string());
        let path = format!(
            "{}{}",
            res.collection_path(namespace),
            query(&[
                ("fieldSelector", params.field_selector.as_deref()),
                ("labelSelector", params.label_selector.as_deref()),
                ("limit", limit_s.as_deref()),
                ("continue", continue_token),
            ])
        );
        let resp = self.send(&request, Method::GET, &path, None).await?;
        let body = self.read_body(&request, resp, self.opts.max_body).await?;
        let list: RawList = serde_json::from_slice(&body).map_err(|source| KubeError::Decode {
            request: request.clone(),
            source,
        })?;
        if list.metadata.resource_version.is_empty() {
            return Err(KubeError::Stream {
                request,
                reason: "list response has no metadata.resourceVersion".into(),
            });
        }
        Ok(ListPage {
            resource_version: list.metadata.resource_version,
            continue_token: list.metadata.continue_token.filter(|c| !c.is_empty()),
            items: list.items.iter().map(|r| r.get().to_string()).collect(),
        })
    }

    /// Asks whether the server has reached `resource_version`: a list of at most one item
    /// with `resourceVersionMatch=NotOlderThan`, served from the apiserver's watch cache. A
    /// version the server does not have yet answers 504 "Too large resource version" (see
    /// [`KubeError::is_resource_version_too_large`]) once the cache has waited 3 s for it. A
    /// watch from such a version is accepted and stays silent until the server's versions
    /// pass it, so this is the only way a client learns that its cursor is ahead.
    pub async fn check_resource_version(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        params: &ListParams,
        resource_version: &str,
    ) -> Result<(), KubeError> {
        let request = Self::request_desc("list", res, None, namespace, None);
        let path = format!(
            "{}{}",
            res.collection_path(namespace),
            query(&[
                ("fieldSelector", params.field_selector.as_deref()),
                ("labelSelector", params.label_selector.as_deref()),
                ("limit", Some("1")),
                ("resourceVersion", Some(resource_version)),
                ("resourceVersionMatch", Some("NotOlderThan")),
            ])
        );
        // The watch cache holds the request up to 3 s waiting for the version before it
        // answers: that is on top of the usual deadline, or the answer is never seen.
        let timeout = self.opts.timeout + WATCH_CACHE_BLOCK;
        let resp = self
            .send_within(&request, Method::GET, &path, None, timeout)
            .await?;
        self.read_body(&request, resp, self.opts.max_body).await?;
        Ok(())
    }

    /// Starts a watch from `resource_version` with bookmarks on. The server ends it after
    /// `timeout_seconds`; the caller then watches again from the last version it saw.
    pub async fn watch(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        params: &ListParams,
        resource_version: &str,
        timeout_seconds: u32,
    ) -> Result<WatchStream, KubeError> {
        let request = Self::request_desc("watch", res, None, namespace, None);
        let timeout_s = timeout_seconds.to_string();
        let path = format!(
            "{}{}",
            res.collection_path(namespace),
            query(&[
                ("fieldSelector", params.field_selector.as_deref()),
                ("labelSelector", params.label_selector.as_deref()),
                ("watch", Some("1")),
                ("resourceVersion", Some(resource_version)),
                ("allowWatchBookmarks", Some("true")),
                ("timeoutSeconds", Some(&timeout_s)),
            ])
        );
        let resp = self.send(&request, Method::GET, &path, None).await?;
        Ok(WatchStream {
            body: resp.into_body(),
            framer: LineFramer::new(self.opts.max_body),
            pending: VecDeque::new(),
            idle: self.opts.watch_idle_timeout,
            request,
            ended: false,
        })
    }

    /// GET one object (raw JSON).
    pub async fn get(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("get", res, None, namespace, Some(name));
        self.call(
            request,
            Method::GET,
            &res.object_path(namespace, name, None),
            None,
        )
        .await
    }

    /// POST a new object.
    pub async fn create(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("create", res, None, namespace, None);
        self.call(
            request,
            Method::POST,
            &res.collection_path(namespace),
            Some(("application/json", body)),
        )
        .await
    }

    /// POST to a subresource of an object, such as `serviceaccounts/NAME/token`.
    pub async fn create_sub(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
        sub: &str,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("create", res, Some(sub), namespace, Some(name));
        self.call(
            request,
            Method::POST,
            &res.object_path(namespace, name, Some(sub)),
            Some(("application/json", body)),
        )
        .await
    }

    /// PUT (replace) an object; the body's `metadata.resourceVersion` makes it conditional.
    pub async fn update(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("update", res, None, namespace, Some(name));
        self.call(
            request,
            Method::PUT,
            &res.object_path(namespace, name, None),
            Some(("application/json", body)),
        )
        .await
    }

    /// PATCH an object or one of its subresources (`status`).
    pub async fn patch(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
        sub: Option<&str>,
        patch: PatchType,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("patch", res, sub, namespace, Some(name));
        self.call(
            request,
            Method::PATCH,
            &res.object_path(namespace, name, sub),
            Some((patch.content_type(), body)),
        )
        .await
    }

    /// DELETE an object, optionally only if its uid still matches.
    pub async fn delete(
        &self,
        res: &Resource,
        namespace: Option<&str>,
        name: &str,
        uid_precondition: Option<&str>,
        grace_period_seconds: Option<i64>,
    ) -> Result<String, KubeError> {
        let request = Self::request_desc("delete", res, None, namespace, Some(name));
        let mut opts = serde_json::json!({"apiVersion": "v1", "kind": "DeleteOptions"});
        if let Some(g) = grace_period_seconds {
            opts["gracePeriodSeconds"] = g.into();
        }
        if let Some(uid) = uid_precondition {
            opts["preconditions"] = serde_json::json!({ "uid": uid });
        }
        self.call(
            request,
            Method::DELETE,
            &res.object_path(namespace, name, None),
            Some(("application/json", opts.to_string().into_bytes())),
        )
        .await
    }
}
