//! The REST API server: routes `api::paths` to the volume service and maps its errors to JSON.
//!
//! Every error answer is an `api::ErrorBody` with a stable code, including malformed requests,
//! unknown paths and wrong methods, so clients never have to parse text. Limits: request bodies
//! are capped at [`REQUEST_BODY_SIZE_BYTES_MAX`], and at most [`REQUESTS_INFLIGHT_MAX`] requests
//! run at once; more are answered `503 busy` at once rather than queued without bound. Volume
//! service calls block (metadata commits fsync), so they run on tokio's blocking pool.

use crate::cluster::SnapshotCopies;
use crate::config::DriveBackend;
use crate::control::{ControlError, VolumeService};
use crate::data_plane::{data_reduction, ErasureReport, ScrubReport, VolumePath, VolumeSpace};
use crate::metrics::{NodeGauges, Registry, ReplicationGauges};
use api::{ErrorBody, ErrorCode, VolumeInfo};
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use meta::{HostAccess, NodeRecord, SnapshotRecord, VolumeRecord};
use nvmf::target::AnaState;
use serde::de::DeserializeOwned;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// The largest request body accepted; API requests are a few hundred bytes.
pub const REQUEST_BODY_SIZE_BYTES_MAX: usize = 64 << 10;
/// Requests served at once; the rest are refused with `busy`.
pub const REQUESTS_INFLIGHT_MAX: usize = 64;

const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the API reports about the node itself.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub record: NodeRecord,
    /// The NVMe/TCP address hosts are told to connect to.
    pub nvme_advertised: SocketAddr,
    pub nvme_serving: bool,
    /// The NBD address clients are told to connect to, if the node serves NBD.
    pub nbd_advertised: Option<SocketAddr>,
    /// What holds the drives' bytes; memory is NOT DURABLE.
    pub drive_backend: DriveBackend,
}

#[derive(Clone)]
struct ApiState {
    service: Arc<VolumeService>,
    metrics: Arc<Registry>,
    node: Arc<NodeView>,
    inflight: Arc<Semaphore>,
}

/// The API's router, ready for `axum::serve`.
pub fn router(service: Arc<VolumeService>, metrics: Arc<Registry>, node: NodeView) -> Router {
    let state = ApiState {
        service,
        metrics,
        node: Arc::new(node),
        inflight: Arc::new(Semaphore::new(REQUESTS_INFLIGHT_MAX)),
    };
    Router::new()
        .route(api::paths::VOLUMES, get(list_volumes).post(create_volume))
        .route(api::paths::VOLUME, get(show_volume).delete(delete_volume))
        .route(api::paths::VOLUME_RESIZE, post(resize_volume))
        .route(api::paths::VOLUME_COMPRESSION, put(set_compression))
        .route(api::paths::VOLUME_HOSTS, get(show_host_access))
        .route(api::paths::VOLUME_HOST, put(allow_host).delete(deny_host))
        .route(api::paths::VOLUME_PATHS, get(show_paths))
        .route(api::paths::VOLUME_PATH, put(set_path_state))
        .route(api::paths::VOLUME_SNAPSHOTS, get(list_snapshots).post(create_snapshot))
        .route(api::paths::VOLUME_SNAPSHOT, get(show_snapshot).delete(delete_snapshot))
        .route(api::paths::VOLUME_ROLLBACK, post(rollback_volume))
        .route(api::paths::VOLUME_RESYNC, get(show_resync))
        .route(api::paths::NODE, get(node_info))
        .route(api::paths::CLUSTER, get(cluster_info))
        .route(api::paths::CLUSTER_VOLUME_FREEZE, post(freeze_volume))
        .route(api::paths::CLUSTER_VOLUME_THAW, post(thaw_volume))
        .route(api::paths::CLUSTER_VOLUME_ROLLBACK, post(rollback_replicated))
        .route(api::paths::CLUSTER_SNAPSHOT, put(take_local_snapshot).delete(drop_local_snapshot))
        .route(api::paths::CLUSTER_SNAPSHOTS, get(held_snapshots))
        .route(api::paths::CLUSTER_CLONE, put(make_local_clone))
        .route(api::paths::DRIVE_REPLACE, post(replace_drive))
        .route(api::paths::METRICS, get(render_metrics))
        .route(api::paths::HEALTHZ, get(healthz))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(REQUEST_BODY_SIZE_BYTES_MAX))
        .with_state(state)
}

/// An error answer: a code (which fixes the HTTP status) and a message for humans.
#[derive(Debug)]
struct ApiError {
    code: ErrorCode,
    message: String,
}

impl ApiError {
    fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
}

impl From<ControlError> for ApiError {
    fn from(error: ControlError) -> Self {
        let code = match &error {
            ControlError::InvalidName(_) => ErrorCode::InvalidName,
            ControlError::InvalidSize(_) => ErrorCode::InvalidSize,
            ControlError::VolumeExists(_) => ErrorCode::VolumeExists,
            ControlError::VolumeNotFound(_) => ErrorCode::VolumeNotFound,
            ControlError::ShrinkRefused { .. } => ErrorCode::ShrinkRefused,
            ControlError::NoSpace { .. } | ControlError::GrowNoSpace { .. } => ErrorCode::NoSpace,
            ControlError::GrowPending { .. } => ErrorCode::ResizePending,
            ControlError::InvalidHost(_) => ErrorCode::InvalidNqn,
            ControlError::HostAccessOpen(_) => ErrorCode::HostAccessOpen,
            ControlError::TooManyHosts(_) => ErrorCode::TooManyHosts,
            ControlError::InvalidPath { .. } | ControlError::InvalidCompression(_) => {
                ErrorCode::InvalidRequest
            }
            ControlError::SnapshotExists { .. } => ErrorCode::SnapshotExists,
            ControlError::SnapshotNotFound { .. } => ErrorCode::SnapshotNotFound,
            ControlError::SnapshotLimit { .. } => ErrorCode::SnapshotLimit,
            ControlError::InvalidSnapshotRef(_) | ControlError::ForeignSnapshot { .. } => {
                ErrorCode::InvalidRequest
            }
            ControlError::CloneTooSmall { .. } => ErrorCode::ShrinkRefused,
            ControlError::DriveNotFound(_) => ErrorCode::DriveNotFound,
            ControlError::ReplaceRefused(_) => ErrorCode::ReplaceRefused,
            ControlError::InvalidDrive(_) => ErrorCode::InvalidDrive,
            ControlError::ReplaceDrive { .. } => {
                tracing::error!(%error, "drive replacement failed");
                ErrorCode::Internal
            }
            ControlError::Placement { .. } => ErrorCode::PlacementFailed,
            ControlError::NotOnCluster(_) => ErrorCode::NotSupported,
            ControlError::SnapshotUnavailable(_) => ErrorCode::SnapshotUnavailable,
            ControlError::DataPlane { .. } | ControlError::Meta(_) => {
                tracing::error!(%error, "volume operation failed");
                ErrorCode::Internal
            }
        };
        Self::new(code, error.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(ErrorBody::new(self.code, self.message))).into_response()
    }
}

/// Runs a volume service call on the blocking pool, within the in-flight limit.
async fn call<T: Send + 'static>(
    state: &ApiState,
    work: impl FnOnce(&VolumeService) -> Result<T, ControlError> + Send + 'static,
) -> Result<T, ApiError> {
    let permit = Arc::clone(&state.inflight).try_acquire_owned().map_err(|_| {
        ApiError::new(ErrorCode::Busy, "the node is serving too many API requests; retry shortly")
    })?;
    let service = Arc::clone(&state.service);
    let joined = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        work(&service)
    })
    .await;
    match joined {
        Ok(result) => result.map_err(ApiError::from),
        Err(error) => {
            tracing::error!(%error, "an API request handler panicked");
            Err(ApiError::new(ErrorCode::Internal, "the request failed inside the node"))
        }
    }
}

fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                ErrorCode::RequestTooLarge,
                format!("the request body is larger than {REQUEST_BODY_SIZE_BYTES_MAX} bytes"),
            )
        } else {
            ApiError::new(ErrorCode::InvalidRequest, rejection.body_text())
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|error| {
        ApiError::new(ErrorCode::InvalidRequest, format!("the request body is not valid: {error}"))
    })
}

fn parse_name(path: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    path.map(|Path(name)| name)
        .map_err(|rejection| ApiError::new(ErrorCode::InvalidName, rejection.body_text()))
}

/// The volume name and host (or port, or snapshot) of a `/v1/volumes/{name}/hosts/{host}`
/// path and its likes.
fn parse_name_and_host(
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, String), ApiError> {
    path.map(|Path(parts)| parts)
        .map_err(|rejection| ApiError::new(ErrorCode::InvalidRequest, rejection.body_text()))
}

fn access_mode(access: &HostAccess) -> api::AccessMode {
    match access {
        HostAccess::Open => api::AccessMode::Open,
        HostAccess::Restricted(_) => api::AccessMode::Restricted,
    }
}

fn host_access(record: &VolumeRecord) -> api::HostAccess {
    api::HostAccess {
        volume: record.name.to_string(),
        nqn: record.name.subsystem_nqn().to_string(),
        access: access_mode(&record.host_access),
        hosts: record.host_access.hosts().map(ToString::to_string).collect(),
    }
}

/// What the API reports of a volume besides its record.
#[derive(Debug, Clone, Default)]
struct VolumeExtras {
    /// On a cluster node, the volume's replication.
    replication: Option<api::ReplicationInfo>,
    /// Reported by answers about one volume only (lists stay stable while data changes).
    space: Option<VolumeSpace>,
    snapshot_count: u32,
    /// The volume's data reduction, if the data path knows its space; 1.0 otherwise.
    reduction: Option<f64>,
}

/// A volume's data reduction from its space.
fn volume_reduction(space: &VolumeSpace) -> f64 {
    data_reduction(space.mapped_bytes, space.physical_used_bytes)
}

fn volume_info(record: &VolumeRecord, node: &NodeView, extras: VolumeExtras) -> VolumeInfo {
    let space = extras.space;
    VolumeInfo {
        name: record.name.to_string(),
        id: record.id,
        size_bytes: record.size_bytes,
        nqn: record.name.subsystem_nqn().to_string(),
        uuid: api::format_uuid(&record.uuid),
        created_unix_ms: record.created_unix_ms,
        nvme_host: node.nvme_advertised.ip().to_string(),
        nvme_port: node.nvme_advertised.port(),
        access: access_mode(&record.host_access),
        mapped_bytes: space.map(|space| space.mapped_bytes),
        physical_used_bytes: space.map(|space| space.physical_used_bytes),
        origin: record
            .origin
            .as_ref()
            .map(|origin| api::snapshot_ref(origin.volume.as_str(), origin.snapshot.as_str())),
        snapshot_count: extras.snapshot_count,
        compression: record.compression.name().to_owned(),
        data_reduction: extras.reduction.unwrap_or(1.0),
        replication: extras.replication,
        nbd_uri: nbd_uri(node, &record.host_access, record.name.as_str()),
    }
}

/// The NBD URI of export `export` of a volume with `access`, if this node exports it: it
/// serves NBD and the volume is open to every host (`crate::nbd`).
fn nbd_uri(node: &NodeView, access: &HostAccess, export: &str) -> Option<String> {
    let address = node.nbd_advertised?;
    access.is_open().then(|| format!("nbd://{address}/{export}"))
}

/// The volume's space and snapshot count, for answers about one volume.
fn volume_extras(
    service: &VolumeService,
    record: &VolumeRecord,
) -> Result<VolumeExtras, ControlError> {
    let space = service.volume_space(record.id);
    Ok(VolumeExtras {
        replication: service
            .cluster()
            .and_then(|cluster| cluster.replication_info(record.id, record.name.as_str())),
        space,
        snapshot_count: service.snapshot_count(&record.name)?,
        reduction: space.as_ref().map(volume_reduction),
    })
}

/// A snapshot's answer. `access` is its volume's host access while the snapshot is served
/// (`None` for a deletion's answer: no longer served). `copies`: on a cluster, where the
/// snapshots' copies are; the answer names their holders, and its NBD URI a holder's export
/// when this node holds no copy.
fn snapshot_info(
    record: &SnapshotRecord,
    exclusive_bytes: u64,
    node: &NodeView,
    access: Option<&HostAccess>,
    copies: Option<&SnapshotCopies>,
) -> api::SnapshotInfo {
    let export = api::snapshot_ref(record.volume.as_str(), record.name.as_str());
    let nbd = |access: &HostAccess| match copies {
        Some(copies) if !copies.held_here(record.id) => {
            let address = copies.holders_of(record.id).find_map(|member| member.nbd_addr.clone());
            address.filter(|_| access.is_open()).map(|address| format!("nbd://{address}/{export}"))
        }
        _ => nbd_uri(node, access, &export),
    };
    let holders = copies
        .map(|copies| copies.holders_of(record.id).map(|member| member.name.clone()).collect());
    api::SnapshotInfo {
        name: record.name.to_string(),
        volume: record.volume.to_string(),
        id: record.id,
        size_bytes: record.size_bytes,
        created_unix_ms: record.created_unix_ms,
        exclusive_bytes,
        nqn: access.map(|_| record.volume.snapshot_nqn(&record.name).to_string()),
        nbd_uri: access.and_then(nbd),
        holders: access.and(holders),
    }
}

async fn list_volumes(State(state): State<ApiState>) -> Result<Json<api::VolumeList>, ApiError> {
    let (records, counts, reductions) = call(&state, |service| {
        let records = service.volumes()?;
        let reductions: Vec<Option<f64>> = records
            .iter()
            .map(|record| service.volume_space(record.id).as_ref().map(volume_reduction))
            .collect();
        Ok((records, service.snapshot_counts()?, reductions))
    })
    .await?;
    let volumes = records
        .iter()
        .zip(reductions)
        .map(|(record, reduction)| {
            let snapshot_count = counts.get(&record.name).copied().unwrap_or(0);
            let extras = VolumeExtras { space: None, snapshot_count, reduction, replication: None };
            volume_info(record, &state.node, extras)
        })
        .collect();
    Ok(Json(api::VolumeList { volumes }))
}

/// `POST /v1/volumes`: an empty volume, or a clone of a snapshot (`from_snapshot`).
async fn create_volume(
    State(state): State<ApiState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<VolumeInfo>), ApiError> {
    let request: api::CreateVolume = parse_body(body)?;
    let compression = request.compression;
    let replicas = request.replicas;
    let record = match (request.from_snapshot, request.size_bytes) {
        (Some(from), size_bytes) => {
            call(&state, move |service| {
                service.create_clone_replicated(
                    &request.name,
                    &from,
                    size_bytes,
                    compression.as_deref(),
                    replicas,
                )
            })
            .await?
        }
        (None, Some(size_bytes)) => {
            call(&state, move |service| {
                service.create_replicated(
                    &request.name,
                    size_bytes,
                    compression.as_deref(),
                    replicas,
                )
            })
            .await?
        }
        (None, None) => {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "the request body is not valid: give size_bytes for an empty volume, or \
                 from_snapshot (VOLUME@SNAPSHOT) for a clone",
            ));
        }
    };
    Ok((StatusCode::CREATED, Json(volume_info(&record, &state.node, VolumeExtras::default()))))
}

async fn show_volume(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<VolumeInfo>, ApiError> {
    let name = parse_name(path)?;
    let (record, extras) = call(&state, move |service| {
        let record = service.volume(&name)?;
        let extras = volume_extras(service, &record)?;
        Ok((record, extras))
    })
    .await?;
    Ok(Json(volume_info(&record, &state.node, extras)))
}

async fn delete_volume(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<VolumeInfo>, ApiError> {
    let name = parse_name(path)?;
    let record = call(&state, move |service| service.delete(&name)).await?;
    Ok(Json(volume_info(&record, &state.node, VolumeExtras::default())))
}

async fn resize_volume(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<VolumeInfo>, ApiError> {
    let name = parse_name(path)?;
    let request: api::ResizeVolume = parse_body(body)?;
    let (record, extras) = call(&state, move |service| {
        let record = service.resize(&name, request.size_bytes)?;
        let extras = volume_extras(service, &record)?;
        Ok((record, extras))
    })
    .await?;
    Ok(Json(volume_info(&record, &state.node, extras)))
}

/// `PUT /v1/volumes/{name}/compression`: how the volume's new writes are stored.
async fn set_compression(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<VolumeInfo>, ApiError> {
    let name = parse_name(path)?;
    let request: api::SetCompression = parse_body(body)?;
    let (record, extras) = call(&state, move |service| {
        let record = service.set_compression(&name, &request.compression)?;
        let extras = volume_extras(service, &record)?;
        Ok((record, extras))
    })
    .await?;
    Ok(Json(volume_info(&record, &state.node, extras)))
}

/// `GET /v1/volumes/{name}/snapshots`: the volume's snapshots, oldest first.
async fn list_snapshots(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<api::SnapshotList>, ApiError> {
    let name = parse_name(path)?;
    let node = Arc::clone(&state.node);
    let snapshots = call(&state, move |service| {
        let records = service.snapshots(&name)?;
        let access = service.volume(&name)?.host_access;
        let copies = service.snapshot_copies().transpose()?;
        Ok(records
            .iter()
            .map(|record| {
                let exclusive_bytes = service.snapshot_exclusive_bytes(record.id);
                snapshot_info(record, exclusive_bytes, &node, Some(&access), copies.as_ref())
            })
            .collect())
    })
    .await?;
    Ok(Json(api::SnapshotList { snapshots }))
}

/// `POST /v1/volumes/{name}/snapshots`: takes a snapshot.
async fn create_snapshot(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<api::SnapshotInfo>), ApiError> {
    let name = parse_name(path)?;
    let request: api::CreateSnapshot = parse_body(body)?;
    let node = Arc::clone(&state.node);
    let info = call(&state, move |service| {
        let record = service.create_snapshot(&name, &request.name)?;
        let access = service.volume(&name)?.host_access;
        let exclusive_bytes = service.snapshot_exclusive_bytes(record.id);
        let copies = service.snapshot_copies().transpose()?;
        Ok(snapshot_info(&record, exclusive_bytes, &node, Some(&access), copies.as_ref()))
    })
    .await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// `GET /v1/volumes/{name}/snapshots/{snapshot}`.
async fn show_snapshot(
    State(state): State<ApiState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<api::SnapshotInfo>, ApiError> {
    let (name, snapshot) = parse_name_and_host(path)?;
    let node = Arc::clone(&state.node);
    let info = call(&state, move |service| {
        let record = service.snapshot(&name, &snapshot)?;
        let access = service.volume(&name)?.host_access;
        let exclusive_bytes = service.snapshot_exclusive_bytes(record.id);
        let copies = service.snapshot_copies().transpose()?;
        Ok(snapshot_info(&record, exclusive_bytes, &node, Some(&access), copies.as_ref()))
    })
    .await?;
    Ok(Json(info))
}

/// `DELETE /v1/volumes/{name}/snapshots/{snapshot}`: answers what the snapshot was.
async fn delete_snapshot(
    State(state): State<ApiState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<api::SnapshotInfo>, ApiError> {
    let (name, snapshot) = parse_name_and_host(path)?;
    let node = Arc::clone(&state.node);
    let info = call(&state, move |service| {
        // Read before the deletion: afterwards the engine no longer knows the snapshot.
        let record = service.snapshot(&name, &snapshot)?;
        let exclusive_bytes = service.snapshot_exclusive_bytes(record.id);
        let deleted = service.delete_snapshot(&name, &snapshot)?;
        Ok(snapshot_info(&deleted, exclusive_bytes, &node, None, None))
    })
    .await?;
    Ok(Json(info))
}

/// `POST /v1/cluster/volumes/{name}/freeze` (between cluster nodes).
async fn freeze_volume(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<api::FreezePoint>, ApiError> {
    let name = parse_name(path)?;
    let request: api::FreezeVolume = parse_body(body)?;
    let held = call(&state, move |service| service.freeze_volume(&name, request.hold_ms)).await?;
    Ok(Json(api::FreezePoint { token: held.token, epoch: held.epoch, copies: held.copies }))
}

/// `POST /v1/cluster/volumes/{name}/rollback` (between cluster nodes, to the primary).
async fn rollback_replicated(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let name = parse_name(path)?;
    let request: api::ReplicatedRollback = parse_body(body)?;
    call(&state, move |service| service.rollback_replicated(&name, request.snapshot_id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/cluster/volumes/{name}/thaw` (between cluster nodes).
async fn thaw_volume(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let name = parse_name(path)?;
    let request: api::ThawVolume = parse_body(body)?;
    call(&state, move |service| service.thaw_volume(&name, request.token)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `PUT /v1/cluster/snapshots/{id}` (between cluster nodes).
async fn take_local_snapshot(
    State(state): State<ApiState>,
    path: Result<Path<u64>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let id = parse_id(path)?;
    let request: api::LocalSnapshot = parse_body(body)?;
    call(&state, move |service| service.take_local_snapshot(id, &request)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /v1/cluster/snapshots/{id}` (between cluster nodes).
async fn drop_local_snapshot(
    State(state): State<ApiState>,
    path: Result<Path<u64>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let id = parse_id(path)?;
    call(&state, move |service| service.drop_local_snapshot(id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/cluster/snapshots` (between cluster nodes).
async fn held_snapshots(
    State(state): State<ApiState>,
) -> Result<Json<api::HeldSnapshots>, ApiError> {
    let ids = call(&state, |service| service.held_snapshots()).await?;
    Ok(Json(api::HeldSnapshots { ids }))
}

/// `PUT /v1/cluster/clones/{id}` (between cluster nodes).
async fn make_local_clone(
    State(state): State<ApiState>,
    path: Result<Path<u64>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let id = parse_id(path)?;
    let request: api::LocalClone = parse_body(body)?;
    call(&state, move |service| service.make_local_clone(id, request.snapshot_id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn parse_id(path: Result<Path<u64>, PathRejection>) -> Result<u64, ApiError> {
    path.map(|Path(id)| id)
        .map_err(|rejection| ApiError::new(ErrorCode::InvalidRequest, rejection.body_text()))
}

/// `POST /v1/volumes/{name}/rollback`.
async fn rollback_volume(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<VolumeInfo>, ApiError> {
    let name = parse_name(path)?;
    let request: api::RollbackVolume = parse_body(body)?;
    let (record, extras) = call(&state, move |service| {
        let record = service.rollback(&name, &request.snapshot)?;
        let extras = volume_extras(service, &record)?;
        Ok((record, extras))
    })
    .await?;
    Ok(Json(volume_info(&record, &state.node, extras)))
}

/// `GET /v1/volumes/{name}/paths`: the volume's NVMe/TCP paths and their ANA states.
async fn show_paths(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<api::VolumePaths>, ApiError> {
    let name = parse_name(path)?;
    let (record, paths) = call(&state, move |service| service.paths(&name)).await?;
    Ok(Json(volume_paths(&record, &paths)))
}

/// `PUT /v1/volumes/{name}/paths/{port}`: sets the volume's ANA state through that port.
async fn set_path_state(
    State(state): State<ApiState>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<api::VolumePaths>, ApiError> {
    let (name, port) = parse_name_and_host(path)?;
    let port_id: u16 = port.parse().map_err(|_| {
        ApiError::new(
            ErrorCode::InvalidRequest,
            format!("{port:?} is not an NVMe port ID (a number from 1; see GET .../paths)"),
        )
    })?;
    let request: api::SetPathState = parse_body(body)?;
    let ana_state = match request.ana_state {
        api::AnaState::Optimized => AnaState::Optimized,
        api::AnaState::NonOptimized => AnaState::NonOptimized,
        api::AnaState::Inaccessible => AnaState::Inaccessible,
        other @ (api::AnaState::PersistentLoss | api::AnaState::Change) => {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "the ANA state {} is set by the cluster, not by hand; set optimized, \
                     non-optimized or inaccessible",
                    other.as_str()
                ),
            ));
        }
    };
    let (record, paths) = call(&state, move |service| {
        let paths = service.set_path_state(&name, port_id, ana_state)?;
        Ok((service.volume(&name)?, paths))
    })
    .await?;
    Ok(Json(volume_paths(&record, &paths)))
}

fn volume_paths(record: &VolumeRecord, paths: &[VolumePath]) -> api::VolumePaths {
    api::VolumePaths {
        volume: record.name.to_string(),
        nqn: record.name.subsystem_nqn().to_string(),
        paths: paths
            .iter()
            .map(|path| api::VolumePath {
                port_id: path.port_id,
                address: crate::advertised(path.address).to_string(),
                ana_state: match path.state {
                    AnaState::Optimized => api::AnaState::Optimized,
                    AnaState::NonOptimized => api::AnaState::NonOptimized,
                    AnaState::Inaccessible => api::AnaState::Inaccessible,
                    AnaState::PersistentLoss => api::AnaState::PersistentLoss,
                    AnaState::Change => api::AnaState::Change,
                },
            })
            .collect(),
    }
}

async fn show_host_access(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<api::HostAccess>, ApiError> {
    let name = parse_name(path)?;
    let record = call(&state, move |service| service.volume(&name)).await?;
    Ok(Json(host_access(&record)))
}

/// `PUT /v1/volumes/{name}/hosts/{host}`: allows the host, or any host for [`api::ANY_HOST`].
async fn allow_host(
    State(state): State<ApiState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<api::HostAccess>, ApiError> {
    let (name, host) = parse_name_and_host(path)?;
    let record = call(&state, move |service| {
        if host == api::ANY_HOST {
            service.allow_any_host(&name)
        } else {
            service.allow_host(&name, &host)
        }
    })
    .await?;
    Ok(Json(host_access(&record)))
}

/// `DELETE /v1/volumes/{name}/hosts/{host}`: denies the host, or every host for
/// [`api::ANY_HOST`].
async fn deny_host(
    State(state): State<ApiState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<api::HostAccess>, ApiError> {
    let (name, host) = parse_name_and_host(path)?;
    let record = call(&state, move |service| {
        if host == api::ANY_HOST {
            service.deny_any_host(&name)
        } else {
            service.deny_host(&name, &host)
        }
    })
    .await?;
    Ok(Json(host_access(&record)))
}

/// `POST /v1/drives/{index}/replace`: a new drive in place of drive `{index}`, rebuilt in the
/// background. The body (`api::ReplaceDrive`) may be empty.
async fn replace_drive(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<api::DriveInfo>, ApiError> {
    let index = path
        .map(|Path(index)| index)
        .map_err(|rejection| ApiError::new(ErrorCode::InvalidRequest, rejection.body_text()))?;
    let index: u16 = index.parse().map_err(|_| {
        ApiError::new(
            ErrorCode::DriveNotFound,
            format!(
                "{index:?} is not a drive index (a number from 0; see GET {})",
                api::paths::NODE
            ),
        )
    })?;
    let request: api::ReplaceDrive = match &body {
        Ok(bytes) if bytes.iter().all(u8::is_ascii_whitespace) => api::ReplaceDrive::default(),
        _ => parse_body(body)?,
    };
    let new_path = request.path.map(std::path::PathBuf::from);
    let size_bytes = state.node.record.drive_size_bytes;
    let status = call(&state, move |service| service.replace_drive(index, new_path)).await?;
    Ok(Json(drive_info(&status, size_bytes)))
}

/// A drive as the API reports it.
fn drive_info(drive: &crate::DriveStatus, size_bytes: u64) -> api::DriveInfo {
    let state = if drive.failed {
        api::DRIVE_STATE_FAILED
    } else if drive.rebuild_percent.is_some() {
        api::DRIVE_STATE_REBUILDING
    } else {
        api::DRIVE_STATE_OK
    };
    api::DriveInfo {
        index: drive.index,
        path: drive.path.display().to_string(),
        size_bytes,
        state: state.to_owned(),
        rebuild_percent: drive.rebuild_percent,
    }
}

/// The erasure coding as the API reports it.
fn erasure_info(report: &ErasureReport) -> api::ErasureInfo {
    let scheme = report.scheme;
    api::ErasureInfo {
        scheme: scheme.to_string(),
        data_shards: scheme.data_shards(),
        parity_shards: scheme.parity_shards(),
        protection: scheme.protection(),
        reconstructed_reads: report.reconstructed_reads,
        repaired_reads: report.repaired_reads,
        unrecoverable_reads: report.unrecoverable_reads,
        rebuild_mb_per_s: report.rebuild_mb_per_s,
        rebuild_busy_mb_per_s: report.rebuild_busy_mb_per_s,
        rebuild: report.rebuild.as_ref().map(|rebuild| api::RebuildInfo {
            drive: rebuild.drive,
            segments_done: rebuild.segments_done,
            segments_total: rebuild.segments_total,
            percent: rebuild.percent(),
            bytes_written: rebuild.bytes_written,
            elapsed_seconds: rebuild.elapsed_seconds,
            bytes_per_second: rebuild.bytes_per_second(),
            eta_seconds: rebuild.eta_seconds(),
            stalled: rebuild.stalled.clone(),
            slowed_for_hosts: rebuild.slowed_for_hosts,
        }),
        last_rebuild: report.last_rebuild.as_ref().map(|end| api::RebuildOutcome {
            drive: end.drive,
            finished: end.finished,
            error: end.error.clone(),
            bytes_written: end.bytes_written,
            seconds: end.seconds,
        }),
    }
}

/// `GET /v1/volumes/{name}/resync`: the copies this node makes as the volume's primary.
async fn show_resync(
    State(state): State<ApiState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<api::ResyncList>, ApiError> {
    let name = parse_name(path)?;
    let resync = call(&state, move |service| {
        let record = service.volume(&name)?;
        match service.cluster() {
            Some(cluster) => Ok(cluster.local_resync(record.id)),
            None => Err(not_on_cluster()),
        }
    })
    .await?;
    Ok(Json(api::ResyncList { resync }))
}

fn not_on_cluster() -> ControlError {
    ControlError::NotOnCluster(
        "this node is not part of a cluster; start it with --cluster-etcd to join one".to_owned(),
    )
}

async fn cluster_info(State(state): State<ApiState>) -> Result<Json<api::ClusterInfo>, ApiError> {
    let info = call(&state, |service| match service.cluster() {
        Some(cluster) => cluster.info().map_err(ControlError::Meta),
        None => Err(not_on_cluster()),
    })
    .await?;
    Ok(Json(info))
}

async fn node_info(State(state): State<ApiState>) -> Result<Json<api::NodeInfo>, ApiError> {
    let (volumes, meta_revision, capacity) = call(&state, |service| {
        Ok((service.volumes()?, service.meta_revision()?, service.capacity()))
    })
    .await?;
    let volume_count = volumes.len() as u64;
    let scrub = scrub_info(&capacity.scrub, &volumes);
    let node = &state.node;
    Ok(Json(api::NodeInfo {
        node_uuid: api::format_uuid(&node.record.uuid),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        drive_count: node.record.drive_count,
        drive_size_bytes: node.record.drive_size_bytes,
        drive_backend: node.drive_backend.as_str().to_owned(),
        created_unix_ms: node.record.created_unix_ms,
        nvme_host: node.nvme_advertised.ip().to_string(),
        nvme_port: node.nvme_advertised.port(),
        nvme_serving: node.nvme_serving,
        volume_count,
        meta_revision,
        capacity: api::Capacity {
            total_bytes: capacity.total_bytes,
            free_bytes: capacity.free_bytes,
            chunk_size_bytes: capacity.chunk_size_bytes,
            provisioned_bytes: capacity.provisioned_bytes,
            mapped_bytes: capacity.mapped_bytes,
            physical_used_bytes: capacity.physical_used_bytes,
            write_amplification: capacity.write_amplification,
            checksum_errors: capacity.checksum_errors,
            mapped_physical_bytes: capacity.mapped_physical_bytes,
            data_reduction: data_reduction(capacity.mapped_bytes, capacity.mapped_physical_bytes),
        },
        drives: capacity
            .drives
            .iter()
            .map(|drive| drive_info(drive, node.record.drive_size_bytes))
            .collect(),
        scrub: Some(scrub),
        erasure: Some(erasure_info(&capacity.erasure)),
    }))
}

/// The scrub as the API reports it. A damaged block's layer label is a volume's id while the
/// volume was never snapshotted or cloned, or the first layer of a snapshotted volume (which
/// the volume reads through): such findings name the volume. Layers made later by snapshots
/// and clones have engine labels with no record, reported as the label alone.
fn scrub_info(report: &ScrubReport, volumes: &[VolumeRecord]) -> api::ScrubInfo {
    let findings = report
        .findings
        .iter()
        .map(|finding| {
            let (kind, volume, layer, block, segment) = match finding.damage {
                engine::log::ScrubDamage::Block { label, block } => {
                    let volume = volumes
                        .iter()
                        .find(|record| record.id == label)
                        .map(|record| record.name.to_string());
                    (api::SCRUB_DAMAGE_BLOCK, volume, Some(label), Some(block), None)
                }
                engine::log::ScrubDamage::Header { segment } => {
                    (api::SCRUB_DAMAGE_HEADER, None, None, None, Some(segment))
                }
                engine::log::ScrubDamage::HeaderChain { segment, .. } => {
                    (api::SCRUB_DAMAGE_HEADER_CHAIN, None, None, None, Some(segment))
                }
                engine::log::ScrubDamage::Parity { segment, .. } => {
                    (api::SCRUB_DAMAGE_PARITY, None, None, None, Some(segment))
                }
            };
            api::ScrubFindingInfo {
                kind: kind.to_owned(),
                volume,
                layer,
                block,
                segment,
                drive: finding.drive,
                location: finding.location,
                pass: finding.pass,
                repaired: finding.repaired,
            }
        })
        .collect();
    api::ScrubInfo {
        state: report.phase.as_str().to_owned(),
        rate_mb_per_s: report.rate_mb_per_s,
        busy_rate_mb_per_s: report.busy_rate_mb_per_s,
        slowed_for_hosts: report.slowed_for_hosts,
        passes_completed: report.passes_completed,
        blocks_verified: report.blocks_verified,
        errors: report.errors,
        pass_progress_percent: report.pass_progress_percent,
        findings,
    }
}

async fn render_metrics(State(state): State<ApiState>) -> Result<Response, ApiError> {
    let drive_backend = state.node.drive_backend;
    let gauges = call(&state, move |service| {
        let capacity = service.capacity();
        let volumes = service.volumes()?;
        let volume_space = volumes
            .iter()
            .filter_map(|record| Some((record.id, service.volume_space(record.id)?)))
            .collect();
        Ok(NodeGauges {
            drive_backend,
            volumes: volumes.len() as u64,
            capacity_total_bytes: capacity.total_bytes,
            capacity_free_bytes: capacity.free_bytes,
            provisioned_bytes: capacity.provisioned_bytes,
            mapped_bytes: capacity.mapped_bytes,
            physical_used_bytes: capacity.physical_used_bytes,
            write_amplification: capacity.write_amplification,
            checksum_errors: capacity.checksum_errors,
            mapped_physical_bytes: capacity.mapped_physical_bytes,
            drives: capacity.drives,
            counters: capacity.counters,
            scrub_blocks_verified: capacity.scrub.blocks_verified,
            scrub_errors: capacity.scrub.errors,
            scrub_passes: capacity.scrub.passes_completed,
            scrub_slowed_for_hosts: capacity.scrub.slowed_for_hosts,
            erasure: capacity.erasure,
            volume_space,
            replication: service.cluster().map(|cluster| {
                let status = &cluster.status;
                let volumes = status.volumes();
                let sum = |stat: fn(&replication::Stats) -> u64| -> u64 {
                    volumes.values().map(|volume| stat(&volume.stats)).sum()
                };
                ReplicationGauges {
                    reads_repaired: sum(|stats| stats.reads_repaired),
                    blocks_repaired: sum(|stats| stats.blocks_repaired),
                    reads_unrecovered: sum(|stats| stats.reads_unrecovered),
                    damaged_found: sum(|stats| stats.damaged_noted),
                    damaged_rewritten: sum(|stats| stats.damaged_rewritten),
                    reconcile_blocks_repaired: sum(|stats| stats.reconcile_repaired),
                    reconcile_unrecovered: sum(|stats| stats.reconcile_unrecovered),
                    entries_refused: sum(|stats| stats.entries_refused),
                    storage_probes: sum(|stats| stats.storage_probes),
                    lease_lapses: status.lease_lapses.load(Ordering::Relaxed),
                    lease_renewals_failed: status.lease_renewals_failed.load(Ordering::Relaxed),
                    frames_sent: status.frames_sent.load(Ordering::Relaxed),
                    frames_received: status.frames_received.load(Ordering::Relaxed),
                    frames_dropped: status.frames_dropped.load(Ordering::Relaxed),
                    volumes: volumes
                        .iter()
                        .map(|(id, volume)| (*id, volume.epoch, volume.serving))
                        .collect(),
                    member_names: cluster
                        .store
                        .members()
                        .map(|members| {
                            members
                                .into_iter()
                                .map(|(member, _)| (member.id.0, member.name))
                                .collect()
                        })
                        .unwrap_or_default(),
                }
            }),
        })
    })
    .await?;
    let text = state.metrics.render(&gauges);
    Ok(([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], text).into_response())
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("no API endpoint {method} {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("the API endpoint {} does not take {method}", uri.path()),
    )
}
