//! PostgreSQL for the end-to-end tests: a fresh database per test, and a
//! relay between the servers and PostgreSQL that a test can cut to make
//! the database go away. PostgreSQL is reached at
//! `COHORT_TEST_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres`.

use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A fresh PostgreSQL database: (its URL, the admin URL to drop it with).
pub fn postgres_database(name: &str) -> (String, String) {
    let admin = std::env::var("COHORT_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_string());
    let name = format!("cohort_e2e_{name}_{}", std::process::id());
    psql(&admin, &format!("DROP DATABASE IF EXISTS {name}"));
    psql(&admin, &format!("CREATE DATABASE {name}"));
    let (base, _) = admin.rsplit_once('/').unwrap();
    (format!("{base}/{name}"), admin)
}

pub fn psql(url: &str, sql: &str) {
    let status = std::process::Command::new("psql")
        .args([url, "-q", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("psql: {e}"));
    assert!(status.success(), "psql failed: {sql}");
}

pub fn drop_postgres_database(url: &str, admin: &str) {
    let (_, name) = url.rsplit_once('/').unwrap();
    psql(admin, &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
}

/// The port of a PostgreSQL URL (5432 when it names none).
pub fn postgres_port(url: &str) -> u16 {
    let (base, _) = url.rsplit_once('/').unwrap();
    let authority = base.rsplit_once('@').map_or(base, |(_, host)| host);
    authority.rsplit_once(':').map_or(5432, |(_, port)| port.parse().unwrap())
}

/// A TCP relay between the server and PostgreSQL that the test can cut:
/// while cut, live connections are reset and new ones refused.
pub struct Relay {
    pub port: u16,
    running: Arc<AtomicBool>,
    sockets: Arc<Mutex<Vec<TcpStream>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    pub fn start(port: u16, upstream: u16) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let running = Arc::new(AtomicBool::new(true));
        let sockets = Arc::new(Mutex::new(Vec::new()));
        let (flag, held) = (running.clone(), sockets.clone());
        let thread = std::thread::spawn(move || {
            while flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else { continue };
                        let mut held = held.lock().unwrap();
                        held.push(client.try_clone().unwrap());
                        held.push(server.try_clone().unwrap());
                        for (mut from, mut to) in
                            [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                        {
                            std::thread::spawn(move || {
                                let _ = std::io::copy(&mut from, &mut to);
                                let _ = to.shutdown(Shutdown::Both);
                            });
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self { port, running, sockets, thread: Some(thread) }
    }

    /// `database_url` (a PostgreSQL URL) through this relay.
    pub fn url_for(&self, database_url: &str) -> String {
        let (base, name) = database_url.rsplit_once('/').unwrap();
        let user = base.split_once("://").unwrap().1.split_once('@').map(|(user, _)| user);
        match user {
            Some(user) => format!("postgres://{user}@127.0.0.1:{}/{name}", self.port),
            None => format!("postgres://127.0.0.1:{}/{name}", self.port),
        }
    }

    /// Resets every relayed connection and stops listening.
    pub fn cut(&mut self) {
        self.running.store(false, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
        for socket in self.sockets.lock().unwrap().drain(..) {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cut();
    }
}
