//! Two projects on one coordinator (THREAT_MODEL, claims 71–74), over real
//! `cohort serve` processes: on SQLite, on PostgreSQL, and through three
//! replicas on PostgreSQL behind HAProxy.
//!
//! * every admin endpoint the OpenAPI document lists answers a key of one
//!   project `404` for the other project's task, token, checkpoint, event
//!   stream, project and key, and changes nothing there;
//! * the lists (tasks, the task list's stream, projects, the audit log,
//!   `/metrics`) hold the key's project only;
//! * a viewer changes nothing (`403` for every endpoint that writes), an
//!   operator runs tasks but manages no key, an owner manages its keys;
//! * the quotas hold: unfinished tasks and parameters (`422`, the quota
//!   named), enrollments per minute and event streams (`429`);
//! * a revoked key and an expired key are refused at once;
//! * every admin action is in the audit log once, with its actor and role,
//!   in the project it acted on, and a refused one with its refusal.

use std::collections::BTreeMap;
use std::time::Duration;

use cohort_server::api::TaskView;
use cohort_server::api::projects::{AuditPage, KeyView, ProjectView, Session};
use cohort_tests::AdminClient;
use cohort_tests::Serve;
use cohort_tests::balancer::Balancer;
use cohort_tests::postgres::{drop_postgres_database, postgres_database};
use cohort_tests::process::json_call;
use serde_json::{Value, json};

const ADMIN: &str = "tenancy-test-admin-token-0123456789";
/// Parameters of the tasks' model.
const DIMENSION: usize = 16;

/// The admin calls, retried while the coordinator answers `503` (through
/// replicas, a task's lead settles in the first second after it is
/// created, and a request about it meanwhile is asked to come back).
trait Retrying {
    fn call_r(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value);
    fn send_r(&self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>);
    fn get_r<T: serde::de::DeserializeOwned>(&self, path: &str) -> T;
}

impl Retrying for AdminClient {
    fn call_r(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let reply = self.call(method, path, body);
            if reply.0 != 503 || std::time::Instant::now() > deadline {
                return reply;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn send_r(&self, method: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let reply = self.send(method, path, body);
            if reply.0 != 503 || std::time::Instant::now() > deadline {
                return reply;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn get_r<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        let (status, body) = self.call_r("GET", path, None);
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_value(body).unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }
}

/// A semi-honest task of a small linear model that no client trains.
fn spec(name: &str, dimension: usize) -> Value {
    json!({
        "name": name,
        "rounds": 50,
        "clients_per_round": 4,
        "model": { "architecture": "linear", "layout": { "tensors": [ { "name": "w", "shape": [dimension] } ] } },
        "secure_aggregation": { "graph": "complete", "threshold": 3, "variant": "semi-honest" }
    })
}

/// What the test expects in a project's audit log: actor, action, outcome.
type Expected = BTreeMap<(String, String, String), usize>;

/// A project with a key of each role, a task and a second enrollment
/// token.
struct Project {
    id: String,
    owner: AdminClient,
    owner_id: String,
    operator: AdminClient,
    operator_id: String,
    viewer: AdminClient,
    viewer_id: String,
    task: String,
    enrollment_token: String,
    token_id: String,
    /// The entries its audit log must hold, as the test acts.
    expected: Expected,
}

impl Project {
    fn expect(&mut self, actor: &str, action: &str, outcome: &str) {
        *self.expected.entry((actor.into(), action.into(), outcome.into())).or_default() += 1;
    }
}

fn created(reply: (u16, Value), what: &str) -> Value {
    assert_eq!(reply.0, 201, "{what}: {}", reply.1);
    reply.1
}

fn new_key(by: &AdminClient, port: u16, project: &str, name: &str, role: &str) -> (AdminClient, String) {
    let body = json!({ "name": name, "role": role });
    let key: KeyView = serde_json::from_value(created(
        by.call_r("POST", &format!("/admin/projects/{project}/keys"), Some(&body)),
        "a key",
    ))
    .unwrap();
    let secret = key.key.unwrap_or_else(|| panic!("a new key is shown once: {}", key.id));
    assert!(secret.starts_with("cohort_key_") && secret.len() == "cohort_key_".len() + 64, "{secret}");
    (AdminClient::new(port, &secret), key.id)
}

fn project(admin: &AdminClient, port: u16, name: &str, quotas: Value) -> Project {
    let view: ProjectView = serde_json::from_value(created(
        admin.call_r("POST", "/admin/projects", Some(&json!({ "name": name, "quotas": quotas }))),
        "a project",
    ))
    .unwrap();
    let (owner, owner_id) = new_key(admin, port, &view.id, "owner", "owner");
    let (operator, operator_id) = new_key(&owner, port, &view.id, "ci", "operator");
    let (viewer, viewer_id) = new_key(&owner, port, &view.id, "analyst", "viewer");
    let task = created(operator.call_r("POST", "/admin/tasks", Some(&spec(name, DIMENSION))), "a task");
    let token = created(
        operator.call_r(
            "POST",
            &format!("/admin/tasks/{}/tokens", task["id"].as_str().unwrap()),
            Some(&json!({ "name": "app" })),
        ),
        "a token",
    );
    let mut project = Project {
        id: view.id,
        owner,
        owner_id,
        operator,
        operator_id,
        viewer,
        viewer_id,
        task: task["id"].as_str().unwrap().into(),
        enrollment_token: task["enrollment_token"].as_str().unwrap().into(),
        token_id: token["id"].as_str().unwrap().into(),
        expected: Expected::new(),
    };
    let (owner_id, operator_id) = (project.owner_id.clone(), project.operator_id.clone());
    project.expect("admin", "project.create", "ok");
    project.expect("admin", "key.create", "ok");
    project.expect(&owner_id, "key.create", "ok");
    project.expect(&owner_id, "key.create", "ok");
    project.expect(&operator_id, "task.create", "ok");
    project.expect(&operator_id, "token.create", "ok");
    project
}

/// The admin operations of the OpenAPI document: (method, path template).
fn admin_operations(port: u16) -> Vec<(String, String)> {
    let (status, document) = json_call(port, "GET", "/openapi.json", None, None);
    assert_eq!(status, 200);
    let mut operations = Vec::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        if !path.starts_with("/admin") {
            continue;
        }
        for method in item.as_object().unwrap().keys() {
            if ["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                operations.push((method.to_uppercase(), path.clone()));
            }
        }
    }
    assert!(operations.len() >= 20, "the document lists the admin API: {operations:?}");
    operations
}

/// `template` about `project`'s resources.
fn path_of(template: &str, project: &Project) -> String {
    template
        .replace("{id}", &project.task)
        .replace("{token}", &project.token_id)
        .replace("{round}", "latest")
        .replace("{project}", &project.id)
        .replace("{key}", &project.viewer_id)
}

/// A body the operation would take, so that a refusal comes from who asks,
/// not from what is sent.
fn body_for(method: &str, template: &str) -> Option<Value> {
    match (method, template) {
        ("POST", "/admin/tasks") => Some(spec("probe", DIMENSION)),
        ("POST", "/admin/projects") => Some(json!({ "name": "probe" })),
        ("POST", t) if t.ends_with("/tokens") => Some(json!({ "name": "probe" })),
        ("POST", t) if t.ends_with("/keys") => Some(json!({ "name": "probe", "role": "owner" })),
        ("PUT", t) if t.ends_with("quotas") => Some(json!({})),
        _ => None,
    }
}

/// The action an operation writes to the audit log (`None`: a read).
fn action_of(method: &str, template: &str) -> Option<&'static str> {
    Some(match (method, template) {
        ("POST", "/admin/tasks") => "task.create",
        ("DELETE", "/admin/tasks/{id}") => "task.delete",
        ("POST", "/admin/tasks/{id}/pause") => "task.pause",
        ("POST", "/admin/tasks/{id}/resume") => "task.resume",
        ("POST", "/admin/tasks/{id}/stop") => "task.stop",
        ("POST", "/admin/tasks/{id}/tokens") => "token.create",
        ("POST", "/admin/tasks/{id}/tokens/{token}/revoke") => "token.revoke",
        ("GET", "/admin/tasks/{id}/checkpoints/{round}") => "checkpoint.download",
        ("POST", "/admin/projects") => "project.create",
        ("PUT", "/admin/projects/{project}/quotas") => "project.quotas",
        ("PUT", "/admin/projects/{project}/owner-quotas") => "project.owner_quotas",
        ("POST", "/admin/projects/{project}/keys") => "key.create",
        ("POST", "/admin/projects/{project}/keys/{key}/revoke") => "key.revoke",
        ("GET", _) => return None,
        other => panic!("an admin operation the test does not know: {other:?}; add it here"),
    })
}

/// The whole project, as its owner reads it: to see that nothing changed.
fn state_of(project: &Project) -> Value {
    let owner = &project.owner;
    let task: TaskView = owner.get_r(&format!("/admin/tasks/{}", project.task));
    json!({
        "status": task.live.status,
        "tokens": owner.get_r::<Value>(&format!("/admin/tasks/{}/tokens", project.task)),
        "keys": owner.get_r::<Value>(&format!("/admin/projects/{}/keys", project.id)),
        "project": owner.get_r::<Value>(&format!("/admin/projects/{}", project.id)),
        "tasks": owner.get_r::<Vec<TaskView>>("/admin/tasks").len(),
    })
}

/// Every entry of `project`'s audit log, read page by page by its owner.
fn audit_log(project: &Project) -> Vec<cohort_server::store::AuditRecord> {
    let mut entries = Vec::new();
    let mut before: Option<i64> = None;
    loop {
        let path = match before {
            Some(seq) => format!("/admin/audit?limit=7&before={seq}"),
            None => "/admin/audit?limit=7".into(),
        };
        let page: AuditPage = project.owner.get_r(&path);
        entries.extend(page.entries);
        match page.next_before {
            Some(seq) => before = Some(seq),
            None => return entries,
        }
    }
}

/// The coordinator (or balancer) at `port` kept two projects apart.
/// `replicas` are the processes' own ports (one, the same as `port`, for
/// a single process).
fn two_projects_share_one_coordinator(port: u16, replicas: &[u16]) {
    let single_process = replicas == [port];
    let admin = AdminClient::new(port, ADMIN);
    let mut a =
        project(&admin, port, "acme", json!({ "parameters": 3 * DIMENSION, "enrollments_per_minute": 2 }));
    let mut b = project(&admin, port, "globex", json!({ "unfinished_tasks": 1, "connections": 1 }));
    let session: Session = a.viewer.get_r("/admin/session");
    assert_eq!((session.role.as_str(), session.project.map(|p| p.id)), ("viewer", Some(a.id.clone())));

    // Every endpoint about B's resources: 404 to A's owner, the most a key
    // of A may do, and nothing of B changes.
    let before = state_of(&b);
    for (method, template) in admin_operations(port) {
        let scoped = template.contains("{id}") || template.contains("{project}");
        if !scoped {
            continue;
        }
        let path = path_of(&template, &b);
        let (status, body) = a.owner.call_r(&method, &path, body_for(&method, &template).as_ref());
        assert_eq!(status, 404, "{method} {path} with another project's key: {body}");
        assert_eq!(body["error"], "not_found", "{method} {path}: {body}");
        // The same answer as for a resource that does not exist.
        let nowhere = path.replace(&b.task, &"0".repeat(32)).replace(&b.id, &"0".repeat(32));
        let (_, missing) = a.owner.call_r(&method, &nowhere, body_for(&method, &template).as_ref());
        assert_eq!(body, missing, "{method} {path}: another project's resource reads as a missing one");
        if let Some(action) = action_of(&method, &template) {
            let owner_id = a.owner_id.clone();
            a.expect(&owner_id, action, "not_found");
            a.expect(&owner_id, action, "not_found");
        }
    }
    // Mixed: A's own task or project with B's token or key in the path.
    for path in [
        format!("/admin/tasks/{}/tokens/{}/revoke", a.task, b.token_id),
        format!("/admin/projects/{}/keys/{}/revoke", a.id, b.viewer_id),
    ] {
        let (status, body) = a.owner.call_r("POST", &path, None);
        assert_eq!((status, body["error"].as_str()), (404, Some("not_found")), "{path}: {body}");
    }
    let owner_id = a.owner_id.clone();
    a.expect(&owner_id, "token.revoke", "not_found");
    a.expect(&owner_id, "key.revoke", "not_found");
    // And the operations without a resource in their path.
    let (status, body) =
        a.operator.call_r("POST", &format!("/admin/tasks?project={}", b.id), Some(&spec("x", DIMENSION)));
    assert_eq!(status, 404, "a task in another project: {body}");
    let operator_id = a.operator_id.clone();
    a.expect(&operator_id, "task.create", "not_found");
    assert_eq!(a.owner.call_r("GET", &format!("/admin/audit?project={}", b.id), None).0, 404);
    let (status, body) = a.owner.call_r("POST", "/admin/projects", Some(&json!({ "name": "mine" })));
    assert_eq!((status, body["error"].as_str()), (403, Some("forbidden")), "{body}");
    let owner_id = a.owner_id.clone();
    a.expect(&owner_id, "project.create", "forbidden");
    assert_eq!(state_of(&b), before, "another project's key changed nothing");

    // The lists hold the key's project only; the admin token sees both.
    let listed: Vec<TaskView> = a.viewer.get_r("/admin/tasks");
    assert_eq!(listed.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(), [a.task.as_str()]);
    assert_eq!(listed[0].project, a.id);
    let projects: Vec<ProjectView> = a.viewer.get_r("/admin/projects");
    assert_eq!(projects.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(), [a.id.as_str()]);
    let all: Vec<TaskView> = admin.get_r("/admin/tasks");
    assert!(all.iter().any(|t| t.id == a.task) && all.iter().any(|t| t.id == b.task));
    let stream = read_stream(port, &a.viewer_secret(), "/admin/events", Duration::from_secs(3));
    assert!(stream.contains(&a.task) && !stream.contains(&b.task) && !stream.contains(&b.id), "{stream}");
    let (_, _, metrics) =
        cohort_tests::process::exchange(port, "GET", "/metrics", Some(&a.viewer_secret()), "text/plain", b"");
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(!metrics.contains(&b.id) && !metrics.contains(&b.task), "{metrics}");
    let (_, _, public) = cohort_tests::process::exchange(port, "GET", "/metrics", None, "text/plain", b"");
    assert!(!String::from_utf8_lossy(&public).contains("project="), "an anonymous scrape sees no task");

    // A viewer changes nothing in its own project: 403 for every write.
    let before = state_of(&a);
    for (method, template) in admin_operations(port) {
        if method == "GET" {
            continue;
        }
        let path = path_of(&template, &a);
        let (status, body) = a.viewer.call_r(&method, &path, body_for(&method, &template).as_ref());
        assert_eq!(status, 403, "{method} {path} with a viewer key: {body}");
        let viewer_id = a.viewer_id.clone();
        a.expect(&viewer_id, action_of(&method, &template).unwrap(), "forbidden");
    }
    assert_eq!(state_of(&a), before, "a viewer changed nothing");
    // A viewer reads, downloads checkpoints (logged), but not the log.
    assert_eq!(a.viewer.send_r("GET", &format!("/admin/tasks/{}/checkpoints/latest", a.task), b"").0, 200);
    let viewer_id = a.viewer_id.clone();
    a.expect(&viewer_id, "checkpoint.download", "ok");
    assert_eq!(a.viewer.call_r("GET", "/admin/audit", None).0, 403);
    // An operator runs its tasks but manages no key.
    assert_eq!(a.operator.call_r("POST", &format!("/admin/tasks/{}/pause", a.task), None).0, 200);
    assert_eq!(a.operator.call_r("POST", &format!("/admin/tasks/{}/resume", a.task), None).0, 200);
    a.expect(&operator_id, "task.pause", "ok");
    a.expect(&operator_id, "task.resume", "ok");
    let (status, _) = a.operator.call_r(
        "POST",
        &format!("/admin/projects/{}/keys", a.id),
        Some(&json!({ "name": "mine", "role": "owner" })),
    );
    assert_eq!(status, 403);
    a.expect(&operator_id, "key.create", "forbidden");

    // Quotas. B may hold one unfinished task: a second is refused, named.
    let (status, body) = b.operator.call_r("POST", "/admin/tasks", Some(&spec("second", DIMENSION)));
    assert_eq!((status, body["error"].as_str()), (422, Some("quota_exceeded")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("unfinished_tasks"), "{body}");
    let b_operator = b.operator_id.clone();
    b.expect(&b_operator, "task.create", "quota_exceeded");
    // A's parameters: 16 held, 32 more fit, 33 do not.
    let (status, body) = a.operator.call_r("POST", "/admin/tasks", Some(&spec("too big", 2 * DIMENSION + 1)));
    assert_eq!((status, body["error"].as_str()), (422, Some("quota_exceeded")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("parameters"), "{body}");
    a.expect(&operator_id, "task.create", "quota_exceeded");
    let fits =
        created(a.operator.call_r("POST", "/admin/tasks", Some(&spec("fits", 2 * DIMENSION))), "a task");
    a.expect(&operator_id, "task.create", "ok");
    let view: ProjectView = a.owner.get_r(&format!("/admin/projects/{}", a.id));
    assert_eq!((view.usage.unfinished_tasks, view.usage.parameters), (2, 3 * DIMENSION as u64));
    // A's enrollments: two a minute over its tasks, then 429, named.
    let enroll = |task: &str, token: &str| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let body = json!({ "enrollment_token": token });
            let reply = json_call(port, "POST", &format!("/v1/tasks/{task}/enroll"), None, Some(body));
            if reply.0 != 503 || std::time::Instant::now() > deadline {
                return reply;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    assert_eq!(enroll(&a.task, &a.enrollment_token).0, 201);
    assert_eq!(enroll(fits["id"].as_str().unwrap(), fits["enrollment_token"].as_str().unwrap()).0, 201);
    let (status, body) = enroll(&a.task, &a.enrollment_token);
    assert_eq!(status, 429, "{body}");
    assert!(body["message"].as_str().unwrap().contains("enrollments_per_minute"), "{body}");
    assert_eq!(enroll(&b.task, &b.enrollment_token).0, 201, "another project's quota is its own");
    let view: ProjectView = a.owner.get_r(&format!("/admin/projects/{}", a.id));
    assert_eq!(view.usage.enrollments_per_minute, 2, "the refused enrollment is not counted");
    // B's keys hold one event stream open at a time, over every replica:
    // one held on the first replica refuses a second on the last (the
    // same process when there is one); asked of the replicas directly, so
    // that a closed stream's place comes back as soon as its replica sees
    // the connection close (behind a balancer, that waits for the
    // balancer to close its side).
    let (mut here, mut there) = (replicas[0], replicas[replicas.len() - 1]);
    let mut first = OpenStream::open(here, &b.viewer_secret(), "/admin/events");
    // Its use, read through any replica, counts it.
    let view: ProjectView = b.owner.get_r(&format!("/admin/projects/{}", b.id));
    assert_eq!(view.usage.connections, 1);
    for _ in 0..2 {
        let second = OpenStream::try_open(there, &b.viewer_secret(), "/admin/events");
        assert!(second.text.starts_with("HTTP/1.1 429"), "{}", second.text);
        assert!(second.text.contains("quota connections"), "{}", second.text);
        drop((first, second));
        // Its place is given back when it closes.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        first = loop {
            let again = OpenStream::try_open(there, &b.viewer_secret(), "/admin/events");
            if again.text.starts_with("HTTP/1.1 200") {
                break again;
            }
            assert!(std::time::Instant::now() < deadline, "the closed stream's place: {}", again.text);
            std::thread::sleep(Duration::from_millis(100));
        };
        // It is held on the other replica now: the next turn asks the first.
        std::mem::swap(&mut here, &mut there);
    }
    drop(first);

    // The admin token sets quotas; an owner may not.
    let (status, _) = a.owner.call_r("PUT", &format!("/admin/projects/{}/quotas", a.id), Some(&json!({})));
    assert_eq!(status, 403);
    a.expect(&owner_id, "project.quotas", "forbidden");
    // An owner holds its project to lower limits of its own, within the
    // operator's quotas; an operator may not, and none may go above them.
    let own = format!("/admin/projects/{}/owner-quotas", a.id);
    let (status, body) = a.owner.call_r("PUT", &own, Some(&json!({ "parameters": 3 * DIMENSION + 1 })));
    assert_eq!((status, body["error"].as_str()), (422, Some("quota_exceeded")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("quota parameters"), "{body}");
    a.expect(&owner_id, "project.owner_quotas", "quota_exceeded");
    let (status, _) = a.operator.call_r("PUT", &own, Some(&json!({ "unfinished_tasks": 1 })));
    assert_eq!(status, 403);
    a.expect(&operator_id, "project.owner_quotas", "forbidden");
    let (status, body) =
        a.owner.call_r("PUT", &own, Some(&json!({ "unfinished_tasks": 1, "connections": 5 })));
    assert_eq!(status, 200, "{body}");
    a.expect(&owner_id, "project.owner_quotas", "ok");
    let view: ProjectView = serde_json::from_value(body).unwrap();
    assert_eq!(view.quotas.unfinished_tasks, None, "the operator's quotas stay as they were");
    assert_eq!((view.owner_quotas.unfinished_tasks, view.owner_quotas.connections), (Some(1), Some(5)));
    let effective = &view.effective_quotas;
    assert_eq!(
        (
            effective.unfinished_tasks,
            effective.parameters,
            effective.enrollments_per_minute,
            effective.connections
        ),
        (Some(1), Some(3 * DIMENSION as u64), Some(2), Some(5))
    );
    // A holds two unfinished tasks: the third is refused by its owners'
    // limit, named, before its parameters are counted.
    let (status, body) = a.operator.call_r("POST", "/admin/tasks", Some(&spec("third", DIMENSION)));
    assert_eq!((status, body["error"].as_str()), (422, Some("quota_exceeded")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("quota unfinished_tasks"), "{body}");
    a.expect(&operator_id, "task.create", "quota_exceeded");

    // A revoked key is refused at once; so is an expired one.
    let revoked: KeyView = serde_json::from_value(
        a.owner.call_r("POST", &format!("/admin/projects/{}/keys/{}/revoke", a.id, a.viewer_id), None).1,
    )
    .unwrap();
    assert!(revoked.revoked_at.is_some());
    a.expect(&owner_id, "key.revoke", "ok");
    let (status, body) = a.viewer.call_r("GET", "/admin/tasks", None);
    assert_eq!(status, 401, "{body}");
    assert!(body["message"].as_str().unwrap().contains("revoked"), "{body}");
    let body = json!({ "name": "short", "role": "viewer", "expires_in_s": 2 });
    let short: KeyView = serde_json::from_value(created(
        a.owner.call_r("POST", &format!("/admin/projects/{}/keys", a.id), Some(&body)),
        "a key",
    ))
    .unwrap();
    a.expect(&owner_id, "key.create", "ok");
    let short = AdminClient::new(port, short.key.as_deref().unwrap());
    assert_eq!(short.call_r("GET", "/admin/tasks", None).0, 200);
    std::thread::sleep(Duration::from_millis(2_100));
    let (status, body) = short.call_r("GET", "/admin/tasks", None);
    assert_eq!(status, 401, "{body}");
    assert!(body["message"].as_str().unwrap().contains("expired"), "{body}");

    // The audit log: each action once, in the project acted on, with its
    // actor, role and outcome; the admin token reads every project's.
    for project in [&a, &b] {
        let entries = audit_log(project);
        let mut seen = Expected::new();
        for entry in &entries {
            assert_eq!(entry.project_id.as_deref(), Some(project.id.as_str()), "{entry:?}");
            let role = match entry.actor.as_str() {
                "admin" => "admin",
                id if id == project.owner_id => "owner",
                id if id == project.operator_id => "operator",
                id if id == project.viewer_id => "viewer",
                other => panic!("an actor of another project in this one's log: {other}: {entry:?}"),
            };
            assert_eq!(entry.role, role, "{entry:?}");
            assert_eq!(entry.outcome == "ok", (200..300).contains(&entry.status), "{entry:?}");
            // The test's own address. Behind HAProxy, which connects from
            // 127.0.2.1, that proves the replicas took each client's address
            // from the balancer's PROXY protocol header.
            assert_eq!(entry.address.as_deref(), Some("127.0.0.1"), "{entry:?}");
            // Through replicas an action may first be asked to come back
            // (`503`, the task's lead settling), which is logged as such;
            // the test retried it. One process has nothing to settle.
            assert!(entry.outcome != "unavailable" || !single_process, "{entry:?}");
            if entry.outcome != "unavailable" {
                *seen
                    .entry((entry.actor.clone(), entry.action.clone(), entry.outcome.clone()))
                    .or_default() += 1;
            }
        }
        assert_eq!(seen, project.expected, "the audit log of {}", project.id);
    }
    let everything: AuditPage = admin.get_r("/admin/audit?limit=500");
    let projects_seen: std::collections::BTreeSet<_> =
        everything.entries.iter().filter_map(|e| e.project_id.clone()).collect();
    assert!(projects_seen.contains(&a.id) && projects_seen.contains(&b.id), "{projects_seen:?}");
}

impl Project {
    /// The viewer key's secret (the client holds it).
    fn viewer_secret(&self) -> String {
        self.viewer.token().to_string()
    }
}

/// The first `limit` of an event stream, as text.
fn read_stream(port: u16, key: &str, path: &str, limit: Duration) -> String {
    let mut stream = OpenStream::open(port, key, path);
    stream.read_for(limit);
    std::mem::take(&mut stream.text)
}

/// An event stream held open on a raw connection.
struct OpenStream {
    stream: std::net::TcpStream,
    text: String,
}

impl OpenStream {
    /// Opens the stream and reads its first half second.
    fn try_open(port: u16, key: &str, path: &str) -> Self {
        use std::io::Write;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\r\n")
            .unwrap();
        stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut opened = Self { stream, text: String::new() };
        opened.read_for(Duration::from_millis(500));
        opened
    }

    /// Opens the stream, which must answer `200`.
    fn open(port: u16, key: &str, path: &str) -> Self {
        let opened = Self::try_open(port, key, path);
        assert!(opened.text.starts_with("HTTP/1.1 200"), "{path}: {}", opened.text);
        opened
    }

    fn read_for(&mut self, limit: Duration) {
        use std::io::Read;
        let deadline = std::time::Instant::now() + limit;
        let mut buffer = [0u8; 16384];
        while std::time::Instant::now() < deadline {
            match self.stream.read(&mut buffer) {
                Ok(0) => return,
                Ok(n) => self.text.push_str(&String::from_utf8_lossy(&buffer[..n])),
                Err(e)
                    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(_) => return,
            }
        }
    }
}

#[test]
fn two_projects_share_a_coordinator_on_sqlite() {
    let serve = Serve::sqlite("tenancy", ADMIN, None);
    two_projects_share_one_coordinator(serve.port, &[serve.port]);
}

#[test]
fn two_projects_share_a_coordinator_on_postgres() {
    let (url, admin) = postgres_database("tenancy");
    let serve = Serve::start(0, &url, ADMIN, None);
    two_projects_share_one_coordinator(serve.port, &[serve.port]);
    drop(serve);
    drop_postgres_database(&url, &admin);
}

/// Through three replicas behind HAProxy: requests about a task are
/// forwarded to the replica that leads it, which checks the key again and
/// logs the action with the caller's address the first replica vouched for,
/// which it read from the balancer's PROXY protocol header.
#[test]
fn two_projects_share_replicas_behind_haproxy() {
    let _heavy = cohort_tests::exclusive();
    let scratch = cohort_tests::scratch("tenancy-replicas");
    let (url, admin) = postgres_database("tenancy_replicas");
    let replicas: Vec<Serve> = (0..3).map(|_| Serve::start(0, &url, ADMIN, None)).collect();
    let ports: Vec<u16> = replicas.iter().map(|r| r.port).collect();
    let balancer = Balancer::start(&scratch, &ports);
    two_projects_share_one_coordinator(balancer.port, &ports);
    drop(balancer);
    drop(replicas);
    drop_postgres_database(&url, &admin);
    std::fs::remove_dir_all(&scratch).unwrap();
}

/// `POST path` with the admin token, `extra` header lines and `body`, from
/// the loopback address `source` to `port`: the status.
fn post_from(source: [u8; 4], port: u16, path: &str, extra: &str, body: &Value) -> u16 {
    use std::io::{Read, Write};
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.bind(&std::net::SocketAddr::from((source, 0)).into()).unwrap();
    socket.connect(&std::net::SocketAddr::from(([127, 0, 0, 1], port)).into()).unwrap();
    let mut stream: std::net::TcpStream = socket.into();
    let body = body.to_string();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN}\r\n{extra}\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.read_to_string(&mut response).unwrap();
    response.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{response}"))
}

/// Behind an HTTP reverse proxy that ends HTTP itself (HAProxy in `mode
/// http` with `option forwardfor`, as nginx's `http` proxy with
/// `$proxy_add_x_forwarded_for`), the coordinator trusts the proxy's own
/// address for `X-Forwarded-For`: the audit log names each client, never
/// an address a client wrote itself, nor the proxy's.
#[test]
fn behind_an_http_proxy_the_audit_log_names_each_client() {
    let scratch = cohort_tests::scratch("tenancy-http-proxy");
    let settings = json!({ "trusted_proxies": [], "trusted_http_proxies": ["127.0.2.2/32"] });
    let serve = Serve::sqlite("tenancy-http-proxy", ADMIN, Some(&settings));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = format!(
        "global\n    maxconn 256\n\n\
         defaults\n    mode http\n    timeout connect 2s\n    timeout client 30s\n    timeout server 30s\n\n\
         frontend cohort\n    bind 127.0.0.1:{port}\n    option forwardfor\n    default_backend coordinator\n\n\
         backend coordinator\n    server only 127.0.0.1:{} source 127.0.2.2\n",
        serve.port
    );
    /// HAProxy, killed when the test ends, however it ends.
    struct Proxy(std::process::Child);
    impl Drop for Proxy {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let proxy = Proxy(
        cohort_server::cluster::balancer::spawn_haproxy_with(&scratch.join("haproxy.cfg"), &config).unwrap(),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let up = || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            && json_call(port, "GET", "/readyz", None, None).0 == 200
    };
    while !up() {
        assert!(std::time::Instant::now() < deadline, "HAProxy did not come up on port {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Through the proxy from 127.0.0.3, which claims another address first:
    // the proxy appends the one it saw, and that is the one taken.
    let forged = "X-Forwarded-For: 203.0.113.66\r\n";
    assert_eq!(post_from([127, 0, 0, 3], port, "/admin/projects", forged, &json!({ "name": "via" })), 201);
    // Straight to the coordinator, a client's header is not read at all.
    assert_eq!(
        post_from([127, 0, 0, 4], serve.port, "/admin/projects", forged, &json!({ "name": "direct" })),
        201
    );
    // A trusted proxy's request whose last entry is no address is refused.
    let bad = "X-Forwarded-For: 127.0.0.5, unknown\r\n";
    assert_eq!(post_from([127, 0, 2, 2], serve.port, "/admin/projects", bad, &json!({ "name": "bad" })), 400);
    let page: AuditPage = AdminClient::new(serve.port, ADMIN).get_r("/admin/audit?limit=50");
    let mut created: Vec<(String, Option<String>)> = page
        .entries
        .iter()
        .filter(|e| e.action == "project.create")
        .map(|e| (e.resource.clone(), e.address.clone()))
        .collect();
    created.sort();
    let ids: Vec<ProjectView> = AdminClient::new(serve.port, ADMIN).get_r("/admin/projects");
    let id_of =
        |name: &str| ids.iter().find(|p| p.name == name).map(|p| format!("projects/{}", p.id)).unwrap();
    let mut expected =
        vec![(id_of("via"), Some("127.0.0.3".to_string())), (id_of("direct"), Some("127.0.0.4".to_string()))];
    expected.sort();
    assert_eq!(created, expected, "{:?}", page.entries);
    drop(proxy);
    drop(serve);
    std::fs::remove_dir_all(&scratch).unwrap();
}
