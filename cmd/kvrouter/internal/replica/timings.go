package replica

import "time"

// Fixed timings of the replica, each with the reason for its value. None is
// a flag: changing one changes how the cluster behaves under failure, so
// they change here, with their tests.
const (
	// leaseFor is how long a worker registration lasts without renewal:
	// kvmock and the registrar renew every 30 s, so three renewals may be
	// lost before the worker expires. Static workers never expire.
	leaseFor = 120 * time.Second

	// poolRenewEvery is how often the leader renews each inference pool
	// worker's registration: kvmock's cadence, four renewals per lease, so
	// a worker outlives a leader's loss and an election; a worker whose pod
	// left the pool while no leader watched expires within leaseFor.
	poolRenewEvery = leaseFor / 4
	// poolRetryEvery is the pause before a failed pool registration is
	// tried again (an election: ~1-2 s here).
	poolRetryEvery = time.Second

	// sessionBindWait bounds how long a session's first turn (or a rebind)
	// waits for its binding to commit while the control group has no
	// leader it can reach (an election, a leader whose address is not yet
	// registered): longer than an election here (~1-2 s), so a turn
	// arriving during a leader change waits for the new leader instead of
	// being served unbound (which would split the session between two
	// workers); bounded, so a cluster without quorum still answers (the
	// turn is then served unbound, counted as a miss). sessionBindRetry is
	// the pause between attempts.
	sessionBindWait  = 5 * time.Second
	sessionBindRetry = 50 * time.Millisecond

	// tickEvery is how often the leader checks whether a lease or a
	// prediction is due to expire (and then stamps its clock into the log).
	// Expiry times are whole seconds apart at best (leases 120 s, the
	// kv-approx TTL 120 s by default), so a second late is noise, and an
	// idle cluster writes nothing.
	tickEvery = time.Second

	// ingestRestartDelay is the pause before the leader rebuilds a stopped
	// event consumer (stream or consumer creation failed, the bus
	// reconnecting): long enough not to spin on a bus that is down, short
	// enough that ingest resumes well inside the consumer's AckWait.
	ingestRestartDelay = time.Second

	// leaderSpreadEvery is how often each replica checks whether it leads
	// a data group another replica should lead (--raft-groups > 1): a
	// moved leader comes back within seconds of its replica's return,
	// while a check costs one configuration read.
	leaderSpreadEvery = 5 * time.Second
	// leaderSpreadMaxBackoff caps the wait after failed transfers. Each
	// attempt refuses this group's applies for up to an election timeout
	// (raft blocks them during a transfer), so a preferred replica that is
	// down is retried at most every two minutes.
	leaderSpreadMaxBackoff = 2 * time.Minute

	// streamKeeperEvery: a data group's leader re-checks its stream and its
	// pending moves this often besides every placement change (a move
	// waits for the old group's backlog of the worker to drain, which no
	// replicated change announces).
	streamKeeperEvery = 250 * time.Millisecond

	// commitTimeout bounds the Raft commit of one KV batch. It equals the
	// consumer's default AckWait (eventbus.ConsumerConfig, 10 s): a batch
	// not committed by then is redelivered anyway, so waiting longer only
	// delays the retry.
	commitTimeout = 10 * time.Second

	// resyncTimeout bounds one resync: the Raft write that clears the stale
	// rank and the worker's reply to the republish request.
	resyncTimeout = 10 * time.Second

	// proposeTimeout bounds one proposal (forwarded to the leader when not
	// leading), below the API's own request deadlines so an admin write
	// answers 503 rather than hang while the cluster elects.
	proposeTimeout = 5 * time.Second

	// readYourWritesWait bounds the wait, after a committed write, until
	// this replica has applied it (a follower lags the leader by a
	// heartbeat): the answer then reflects the write; past it, the write
	// still holds and the answer is merely a moment old.
	readYourWritesWait = 2 * time.Second

	// registerSelfRetry and registerStaticRetry pace the start-up writes
	// that wait for the cluster to take writes (an election, a join).
	registerSelfRetry   = 250 * time.Millisecond
	registerStaticRetry = 500 * time.Millisecond

	// predictionGather is how long kv-approx predictions gather after the
	// first one before they are proposed: a burst of routed requests
	// becomes one command per worker instead of one per request.
	predictionGather = 5 * time.Millisecond

	// healthCheckMax caps the period of the events-missing check (a quarter
	// of --events-missing-after otherwise), so a long limit still flags
	// within a few seconds of passing it.
	healthCheckMax = 5 * time.Second

	// drainPoll is how often the drain looks at the in-flight count.
	drainPoll = 50 * time.Millisecond

	// shutdownTimeout bounds the HTTP server's shutdown and the Raft node's
	// (leadership transfer first) after the drain.
	shutdownTimeout = 15 * time.Second

	// insecureReminder is how often a replica without TLS on its bus says
	// so in its log: an insecure cluster must never look like a secure one.
	insecureReminder = time.Minute

	// firstByteTimeout bounds the wait for a new HTTP connection's first
	// byte (which tells TLS from plaintext): net/http's ReadHeaderTimeout
	// (10 s) bounds the rest of the headers the same way.
	firstByteTimeout = 10 * time.Second

	// bridgeHTTPTimeout is the in-replica bridge's HTTP client timeout,
	// zmqbridge's own default.
	bridgeHTTPTimeout = 5 * time.Second
)
