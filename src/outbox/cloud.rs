//! The apiserver as the outbox sees it: the few writes a report needs. A trait, so the
//! sender's rules are tested against an in-memory fake as well as the fake apiserver.

use crate::kube::resource::{EVENTS, PODS};
use crate::kube::{ApiClient, KubeError, PatchType};
use std::future::Future;

pub trait Cloud: Send + Sync {
    /// PATCH `pods/<name>/status` (strategic merge); the answer is the pod.
    fn patch_pod_status(
        &self,
        namespace: &str,
        name: &str,
        body: Vec<u8>,
    ) -> impl Future<Output = Result<String, KubeError>> + Send;
    fn create_event(
        &self,
        namespace: &str,
        body: Vec<u8>,
    ) -> impl Future<Output = Result<String, KubeError>> + Send;
    /// PATCH an Event (strategic merge). There is no GET: a node may create and patch Events
    /// but never read them (403), so a series is kept on the device.
    fn patch_event(
        &self,
        namespace: &str,
        name: &str,
        body: Vec<u8>,
    ) -> impl Future<Output = Result<String, KubeError>> + Send;
    /// DELETE a pod with a uid precondition and grace 0.
    fn delete_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> impl Future<Output = Result<String, KubeError>> + Send;
    /// PATCH a pod (strategic merge): images and labels, for identities that may.
    fn patch_pod(
        &self,
        namespace: &str,
        name: &str,
        body: Vec<u8>,
    ) -> impl Future<Output = Result<String, KubeError>> + Send;
}

impl Cloud for ApiClient {
    async fn patch_pod_status(
        &self,
        namespace: &str,
        name: &str,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        self.patch(
            &PODS,
            Some(namespace),
            name,
            Some("status"),
            PatchType::StrategicMerge,
            body,
        )
        .await
    }

    async fn create_event(&self, namespace: &str, body: Vec<u8>) -> Result<String, KubeError> {
        self.create(&EVENTS, Some(namespace), body).await
    }

    async fn patch_event(
        &self,
        namespace: &str,
        name: &str,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        self.patch(
            &EVENTS,
            Some(namespace),
            name,
            None,
            PatchType::StrategicMerge,
            body,
        )
        .await
    }

    async fn delete_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<String, KubeError> {
        self.delete(&PODS, Some(namespace), name, Some(uid), Some(0))
            .await
    }

    async fn patch_pod(
        &self,
        namespace: &str,
        name: &str,
        body: Vec<u8>,
    ) -> Result<String, KubeError> {
        self.patch(
            &PODS,
            Some(namespace),
            name,
            None,
            PatchType::StrategicMerge,
            body,
        )
        .await
    }
}
