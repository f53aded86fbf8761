// Package tenant keeps tenants' fair shares across a fleet of router
// replicas (issue 28 item 3): who a request is served for, each tenant's
// virtual token counter (this replica's charges plus every other replica's
// as replica sync reports them), the lift that keeps idling from banking
// credit, the yield rule that makes per-replica queues one fleet-wide
// order, and the per-tenant budgets. It is pure bookkeeping (no network,
// no metrics, its clock injected), so the live router (api) and the
// simulator (kvbench sim) run the same code.
//
// A tenant is who a request is served for: the client's API key (hashed,
// never the key itself), a header the operator names (GAIE's
// x-gateway-inference-fairness-id by default), or nobody (fairness off).
// Each tenant of a model has a virtual token counter: the uncached prompt
// tokens its requests made a worker prefill plus the output tokens they
// generated, summed over every replica (each replica publishes its own
// charges on replica sync; the ledger adds them up). Within a strict class
// the admission queue serves the backlogged tenant with the smallest
// counter first (start-time fair queueing): a tenant that was idle starts
// at the smallest counter among the active tenants, so idling banks no
// credit: its lift (what was added to its counter to get there) travels
// with its usage, so every replica sees the same lift.
package tenant

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode"
)

// Source says where a request's tenant comes from.
type Source string

// Tenant sources (--tenant-from).
const (
	SourceNone   Source = "none"    // fairness off: every request is one tenant
	SourceAPIKey Source = "api-key" // the client's bearer key, hashed
	SourceHeader Source = "header"  // the value of Config.Header
)

// DefaultHeader is GAIE's flow-control fairness id header.
const DefaultHeader = "x-gateway-inference-fairness-id"

// Tenant ids: at most this long and of printable non-space characters; a
// longer or stranger header value is hashed to one that is.
const maxTenantIDLen = 64

// Special tenant ids.
const (
	Anonymous   = "_anonymous" // no key or no header
	Overflow    = "_overflow"  // beyond MaxTenants: one shared share
	tenantOther = "_other"     // metrics beyond MetricTenants
)

// Config configures tenant fairness. Zero fields take the defaults.
type Config struct {
	From   Source
	Header string // SourceHeader's header (default DefaultHeader)
	// MaxTenants bounds the tenants tracked per model (default 1024):
	// every tenant beyond shares Overflow's counter, so a client
	// inventing ids cannot grow the ledger, the sync messages or the
	// queue's lanes without bound.
	MaxTenants int
	// MetricTenants bounds the tenants with their own metric series
	// (default 32, first come); the others are summed under "_other".
	MetricTenants int
	// Budgets, per tenant and fleet-wide as far as replica sync has told
	// this replica (0: none): tokens charged in the last minute, and
	// requests admitted and not finished. Beyond either: 429 with
	// Retry-After.
	TokensPerMinute int64
	MaxConcurrent   int
	// Burst is how far below the least served active tenant a tenant may
	// be when it starts or queues a request (default 4096 tokens; 1 is
	// start-time fair queueing exactly): the credit a tenant below its
	// share may spend at once, and all the credit idling can bank.
	Burst float64
	// Slack is how many tokens a tenant waiting on another replica must be
	// below this replica's next tenant before this replica holds its
	// request back for it (default 512): the margin that keeps replicas
	// from yielding to each other on small differences of stale counts.
	// It must stay well below Burst, or a tenant that came back Burst
	// below the others would get no yield from the other replicas.
	Slack float64
	// MaxYield bounds how long a queue head, with capacity free, holds
	// back for another replica's waiter (default 250 ms): one there is
	// admitted within a wake, so a longer hold means a report that no
	// longer holds, and capacity must not stay idle for it.
	MaxYield time.Duration
	// ForgetAfter drops a tenant idle here and everywhere for that long
	// (default 2 minutes, past the budgets' minute): it comes back lifted
	// like any idle tenant, so its old count no longer matters, and the
	// ledger and the sync messages hold only tenants seen lately.
	ForgetAfter time.Duration
	// Headroom holds a tenant over its share, while other tenants are
	// active, to its share of each worker's admission window (Window).
	Headroom bool
	// EnginePriority: the proxy sets each forwarded request's engine
	// priority (vLLM's and SGLang's body field "priority", lower served
	// first) from EnginePriority. The ledger does not read it; api does.
	EnginePriority bool
	// LatencyGuard (0: off; else a factor of at least 1): a request of a
	// tenant over its share, while another tenant is active (the rule of
	// Window), goes only to a worker where a fresh request is predicted
	// to get its TTFT and TPOT within LatencyGuard × their values on an
	// idle worker (router.Router.LatencyGuard); with none, it waits in
	// the queue. The ledger says who is guarded (Guard); the router
	// judges the workers.
	LatencyGuard float64
	// Isolation (0: off; else a safety factor of at least 1): while a
	// tenant is over its share, k of a model's workers are reserved for
	// the tenants under theirs, k from their recent share of the tokens
	// charged fleet-wide times this factor (isolation.go, Isolation and
	// ReservedWorkers). The ledger says k and who is over; api and the
	// simulator keep the over-share tenant off the reserved workers.
	Isolation float64
	Now       func() time.Time // default time.Now
}

// MaxPublished bounds one replica's sync message (NATS refuses
// payloads over 1 MiB by default; an entry is ~50 bytes): the active
// tenants first, then the most charged.
const MaxPublished = 8192

// Usage is one tenant's state on one replica, as replica sync
// carries it. Tokens and Lift only grow while the replica runs.
type Usage struct {
	Model  string
	Tenant string
	Tokens uint64 // tokens charged by that replica
	// Lift is what that replica added to the tenant's counter when the
	// tenant last became active after idling (start-time fair queueing):
	// the counter is the fleet's tokens plus the largest Lift.
	Lift uint64
	// Waiting is its requests in that replica's queue; Class the highest
	// class among them. Inflight is its requests admitted and not done.
	Waiting  int
	Class    uint32
	Inflight int
}

type tenantKey struct{ model, tenant string }

// tenantLocal is one tenant's state on this replica.
type tenantLocal struct {
	used     uint64
	lift     uint64
	waiting  map[uint32]int // by class
	inflight int
	minute   tokenMinute
	seen     time.Time // the last time it began, ended, queued or was charged
	series   string    // the metric label
}

func (t *tenantLocal) waitingTotal() (n int, top uint32) {
	for c, k := range t.waiting {
		n += k
		if k > 0 && c > top {
			top = c
		}
	}
	return n, top
}

// Ledger keeps the tenants' virtual token counters, this replica's
// and the fleet's as replica sync reports them, and their budgets. Safe for
// concurrent use.
type Ledger struct {
	cfg Config

	// changed gets a token when a tenant starts waiting here (replica
	// sync publishes at once rather than at its next interval: the other
	// replicas must yield to it, and each interval they do not costs it).
	changed chan struct{}

	mu     sync.Mutex
	local  map[tenantKey]*tenantLocal
	remote map[string]map[tenantKey]Usage // by replica
	series map[string]bool                // tenants with their own metric series
	// recent is each tenant's tokens over the last RecentWindow, fleet-wide
	// (this replica's charges and the growth of every other's reports),
	// kept with Config.Isolation only.
	recent map[tenantKey]*recentTokens
	// isoWorkers is each model's worker count as Isolation or
	// IsolationPasses last saw it (Guard applies the isolation rule,
	// which needs it, without being told).
	isoWorkers map[string]int
}

// New returns an empty ledger; nil when cfg.From is none or
// empty (fairness off).
func New(cfg Config) (*Ledger, error) {
	switch cfg.From {
	case "", SourceNone:
		return nil, nil
	case SourceAPIKey, SourceHeader:
	default:
		return nil, fmt.Errorf("tenant source %q (want none, api-key or header)", cfg.From)
	}
	if cfg.Header == "" {
		cfg.Header = DefaultHeader
	}
	if cfg.MaxTenants <= 0 {
		cfg.MaxTenants = 1024
	}
	if cfg.MetricTenants <= 0 {
		cfg.MetricTenants = 32
	}
	if cfg.Slack <= 0 {
		cfg.Slack = 512
	}
	if cfg.Burst == 0 {
		cfg.Burst = 4096
	}
	if cfg.Burst < 1 {
		return nil, fmt.Errorf("tenant burst must be at least 1 token, got %v", cfg.Burst)
	}
	if cfg.TokensPerMinute < 0 || cfg.MaxConcurrent < 0 {
		return nil, fmt.Errorf("tenant budgets must not be negative")
	}
	if g := cfg.LatencyGuard; g != 0 && !(g >= 1 && !math.IsInf(g, 1)) {
		return nil, fmt.Errorf("tenant latency guard %v: want 0 (off) or a finite factor of at least 1 (a fresh request's predicted TTFT and TPOT on a worker over their idle values)", g)
	}
	if !ValidateIsolation(cfg.Isolation) {
		return nil, fmt.Errorf("tenant isolation %v: want 0 (off) or a finite safety factor of at least 1 (the workers reserved for tenants under their share, over their recent share of the fleet's tokens times the worker count)", cfg.Isolation)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.ForgetAfter <= 0 {
		cfg.ForgetAfter = 2 * time.Minute
	}
	if cfg.MaxYield <= 0 {
		cfg.MaxYield = 250 * time.Millisecond
	}
	return &Ledger{cfg: cfg, local: map[tenantKey]*tenantLocal{}, remote: map[string]map[tenantKey]Usage{},
		series: map[string]bool{}, changed: make(chan struct{}, 1), recent: map[tenantKey]*recentTokens{}, isoWorkers: map[string]int{}}, nil
}

// Config is the ledger's configuration, defaults filled.
func (l *Ledger) Config() Config { return l.cfg }

// Identify returns the tenant of a request from its bearer key and
// headers' getter. Raw keys never leave here: an API key becomes
// "key-" and 12 hex digits of its SHA-256.
func (l *Ledger) Identify(bearer string, header func(string) string) string {
	switch l.cfg.From {
	case SourceAPIKey:
		if bearer == "" {
			return Anonymous
		}
		sum := sha256.Sum256([]byte("kvrouter tenant\x00" + bearer))
		return "key-" + hex.EncodeToString(sum[:6])
	case SourceHeader:
		return tenantID(header(l.cfg.Header))
	}
	return ""
}

// tenantID makes a header value a tenant id: kept when short and
// printable, hashed otherwise.
func tenantID(v string) string {
	v = strings.TrimSpace(v)
	if v == "" {
		return Anonymous
	}
	ok := len(v) <= maxTenantIDLen && !strings.HasPrefix(v, "_")
	for _, r := range v {
		if !ok {
			break
		}
		ok = unicode.IsPrint(r) && !unicode.IsSpace(r)
	}
	if ok {
		return v
	}
	sum := sha256.Sum256([]byte(v))
	return "h-" + hex.EncodeToString(sum[:8])
}

// localLocked returns the tenant's local state, creating it (or the
// overflow tenant's, past MaxTenants). mu must be held.
func (l *Ledger) localLocked(k tenantKey) (*tenantLocal, tenantKey) {
	if t, ok := l.local[k]; ok {
		return t, k
	}
	if l.tenantsLocked(k.model) >= l.cfg.MaxTenants {
		k.tenant = Overflow
		if t, ok := l.local[k]; ok {
			return t, k
		}
	}
	t := &tenantLocal{waiting: map[uint32]int{}}
	if len(l.series) < l.cfg.MetricTenants || l.series[k.tenant] {
		l.series[k.tenant] = true
		t.series = k.tenant
	} else {
		t.series = tenantOther
	}
	l.local[k] = t
	return t, k
}

// tenantsLocked counts a model's local tenants. mu must be held.
func (l *Ledger) tenantsLocked(model string) int {
	n := 0
	for k := range l.local {
		if k.model == model {
			n++
		}
	}
	return n
}

// Resolve maps a tenant to the id its share is kept under (Overflow
// past MaxTenants).
func (l *Ledger) Resolve(model, tenant string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, k := l.localLocked(tenantKey{model, tenant})
	return k.tenant
}

// fleetLocked is the tenant's tokens over the fleet and its largest lift.
// mu must be held.
func (l *Ledger) fleetLocked(k tenantKey) (used, lift uint64) {
	if t, ok := l.local[k]; ok {
		used, lift = t.used, t.lift
	}
	for _, rs := range l.remote {
		if u, ok := rs[k]; ok {
			used += u.Tokens
			lift = max(lift, u.Lift)
		}
	}
	return used, lift
}

// virtualLocked is a tenant's virtual token counter: its tokens over the
// fleet plus its lift. mu must be held.
func (l *Ledger) virtualLocked(k tenantKey) float64 {
	used, lift := l.fleetLocked(k)
	return float64(used) + float64(lift)
}

// activeLocked reports whether a tenant has work waiting or running
// anywhere in the fleet. mu must be held.
func (l *Ledger) activeLocked(k tenantKey) bool {
	if t, ok := l.local[k]; ok {
		if n, _ := t.waitingTotal(); n > 0 || t.inflight > 0 {
			return true
		}
	}
	for _, rs := range l.remote {
		if u, ok := rs[k]; ok && (u.Waiting > 0 || u.Inflight > 0) {
			return true
		}
	}
	return false
}

// keysLocked lists every tenant of model this replica knows of, sorted.
// mu must be held.
func (l *Ledger) keysLocked(model string) []tenantKey {
	seen := map[tenantKey]bool{}
	for k := range l.local {
		if k.model == model {
			seen[k] = true
		}
	}
	for _, rs := range l.remote {
		for k := range rs {
			if k.model == model {
				seen[k] = true
			}
		}
	}
	out := make([]tenantKey, 0, len(seen))
	for k := range seen {
		out = append(out, k)
	}
	slices.SortFunc(out, func(a, b tenantKey) int { return strings.Compare(a.tenant, b.tenant) })
	return out
}

// Virtual is a tenant's virtual token counter (tests, status).
func (l *Ledger) Virtual(model, tenant string) float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.virtualLocked(tenantKey{model, tenant})
}

// Less orders two tenants of a model for the queue: the smaller virtual
// counter goes first.
func (l *Ledger) Less(model string) func(a, b string) bool {
	return func(a, b string) bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.virtualLocked(tenantKey{model, a}) < l.virtualLocked(tenantKey{model, b})
	}
}

// Enqueue records a request of tenant waiting in class. A tenant idle
// fleet-wide until now is lifted to the smallest counter among the active
// tenants (start-time fair queueing: idling banks no credit).
func (l *Ledger) Enqueue(model, tenant string, class uint32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.liftLocked(tenantKey{model, tenant})
	t, _ := l.localLocked(tenantKey{model, tenant})
	t.seen = l.cfg.Now()
	if n, top := t.waitingTotal(); n == 0 || class > top {
		select { // the tenant now waits here (or in a higher class)
		case l.changed <- struct{}{}:
		default:
		}
	}
	t.waiting[class]++
}

// Changed gets a token when a tenant starts waiting on this replica, or
// waits in a higher class than before: replica sync then publishes the
// usage without waiting for its interval.
func (l *Ledger) Changed() <-chan struct{} { return l.changed }

// Dequeue undoes Enqueue (admitted or gone).
func (l *Ledger) Dequeue(model, tenant string, class uint32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, _ := l.localLocked(tenantKey{model, tenant})
	t.seen = l.cfg.Now()
	if t.waiting[class]--; t.waiting[class] <= 0 {
		delete(t.waiting, class)
	}
}

// liftLocked keeps a tenant's counter at least Burst below the smallest
// counter among the other active tenants, by raising its lift. Called when
// the tenant starts a request or queues one: a tenant that was idle (or
// fell behind) comes back at most Burst tokens ahead of the least served
// active tenant. With Burst 1 this is start-time fair queueing's rule (the
// newcomer's start tag is the virtual time of the request in service, one
// token below the active tenants', whose counters already include the
// requests they are being served); more lets a tenant below its share
// burst that many tokens before it alternates. Either way, idling banks no
// more credit than Burst. mu must be held.
func (l *Ledger) liftLocked(k tenantKey) {
	low, found := math.Inf(1), false
	for _, o := range l.keysLocked(k.model) {
		if o != k && l.activeLocked(o) {
			low, found = min(low, l.virtualLocked(o)), true
		}
	}
	if !found {
		return
	}
	low = max(low-l.cfg.Burst, 0)
	used, lift := l.fleetLocked(k)
	if float64(used)+float64(lift) >= low {
		return
	}
	t, _ := l.localLocked(k)
	t.lift = max(t.lift, uint64(low)-used)
}

// Begin counts a request of tenant admitted (in flight) after checking the
// tenant's budgets: when one is spent it counts nothing and returns how
// long until the budget allows the request again.
func (l *Ledger) Begin(model, tenant string) (retryAfter time.Duration, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	k := tenantKey{model, tenant}
	now := l.cfg.Now()
	if l.cfg.MaxConcurrent > 0 {
		n := 0
		if t, ok := l.local[k]; ok {
			n += t.inflight
		}
		for _, rs := range l.remote {
			n += rs[k].Inflight
		}
		if n >= l.cfg.MaxConcurrent {
			return time.Second, false
		}
	}
	t, _ := l.localLocked(k)
	if l.cfg.TokensPerMinute > 0 {
		if used := t.minute.sum(now); used >= l.cfg.TokensPerMinute {
			return t.minute.until(now, used-l.cfg.TokensPerMinute+1), false
		}
	}
	l.liftLocked(k)
	t.inflight++
	t.seen = now
	return 0, true
}

// End counts a request of tenant finished.
func (l *Ledger) End(model, tenant string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, _ := l.localLocked(tenantKey{model, tenant})
	t.inflight = max(t.inflight-1, 0)
	t.seen = l.cfg.Now()
}

// Charge adds tokens to tenant's counter: uncached prompt tokens when a
// request is routed, output tokens as the worker reports them.
func (l *Ledger) Charge(model, tenant string, tokens int) {
	if tokens <= 0 {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	t, _ := l.localLocked(tenantKey{model, tenant})
	t.used += uint64(tokens)
	t.seen = l.cfg.Now()
	t.minute.add(t.seen, int64(tokens))
	l.recentLocked(tenantKey{model, tenant}, t.seen, uint64(tokens))
}

// Usage is this replica's state of its tenants, for replica sync, sorted:
// at most MaxPublished, the active first. It first forgets the
// tenants idle everywhere for ForgetAfter.
func (l *Ledger) Usage() []Usage {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.cfg.Now()
	out := make([]Usage, 0, len(l.local))
	for k, t := range l.local {
		if now.Sub(t.seen) > l.cfg.ForgetAfter && !l.activeLocked(k) {
			delete(l.local, k)
			delete(l.recent, k)
			continue
		}
		n, top := t.waitingTotal()
		out = append(out, Usage{Model: k.model, Tenant: k.tenant, Tokens: t.used, Lift: t.lift,
			Waiting: n, Class: top, Inflight: t.inflight})
	}
	for k, r := range l.recent {
		if r.sum(now) == 0 {
			delete(l.recent, k) // nothing recent: the isolation rule reads it as 0 anyway
		}
	}
	if len(out) > MaxPublished {
		slices.SortFunc(out, func(a, b Usage) int {
			if aa, ba := a.Waiting+a.Inflight > 0, b.Waiting+b.Inflight > 0; aa != ba {
				if aa {
					return -1
				}
				return 1
			}
			return cmp.Compare(b.Tokens, a.Tokens)
		})
		out = out[:MaxPublished]
	}
	slices.SortFunc(out, func(a, b Usage) int {
		if c := strings.Compare(a.Model, b.Model); c != 0 {
			return c
		}
		return strings.Compare(a.Tenant, b.Tenant)
	})
	return out
}

// Remote replaces what replica said of its tenants. Tokens it charged
// since its previous report count toward the tenants' per-minute budgets
// here too. At most MaxTenants tenants per model are kept.
func (l *Ledger) Remote(replica string, usage []Usage) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.cfg.Now()
	prev, known := l.remote[replica]
	next := make(map[tenantKey]Usage, len(usage))
	perModel := map[string]int{}
	for _, u := range usage {
		k := tenantKey{u.Model, u.Tenant}
		if perModel[u.Model] >= l.cfg.MaxTenants {
			continue
		}
		perModel[u.Model]++
		if p, ok := prev[k]; ok && u.Tokens > p.Tokens {
			if t, ok := l.local[k]; ok && l.cfg.TokensPerMinute > 0 {
				t.minute.add(now, int64(min(u.Tokens-p.Tokens, math.MaxInt64/2)))
			}
			l.recentLocked(k, now, u.Tokens-p.Tokens)
		} else if !ok && known {
			// A tenant new in a replica's report: all of it is recent. A
			// replica's first report is its baseline instead: what it
			// charged before this replica heard it is not recent here.
			l.recentLocked(k, now, u.Tokens)
		}
		next[k] = u
	}
	l.remote[replica] = next
}

// DropRemote forgets a replica that went silent or restarted.
func (l *Ledger) DropRemote(replica string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.remote, replica)
}

// YieldTo reports whether this replica should hold back the request of
// tenant in class for a tenant waiting on another replica: one waiting in
// a higher class, or in the same class with a counter more than Slack
// below this tenant's. It returns that tenant.
func (l *Ledger) YieldTo(model, tenant string, class uint32) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	mine := l.virtualLocked(tenantKey{model, tenant})
	for _, replica := range slices.Sorted(maps.Keys(l.remote)) {
		for k, u := range l.remote[replica] {
			if k.model != model || k.tenant == tenant || u.Waiting <= 0 {
				continue
			}
			if u.Class > class || (u.Class == class && l.virtualLocked(k)+l.cfg.Slack < mine) {
				return k.tenant, true
			}
		}
	}
	return "", false
}

// Status is one tenant of /cluster/status: its counter and what
// this replica knows of it fleet-wide.
type Status struct {
	Model    string  `json:"model"`
	Tenant   string  `json:"tenant"`
	Tokens   uint64  `json:"tokens"`  // charged over the fleet
	Virtual  float64 `json:"virtual"` // tokens plus lift: the queue's order
	Waiting  int     `json:"waiting"` // queued over the fleet
	Inflight int     `json:"inflight"`
	Here     uint64  `json:"tokens_here"` // charged by this replica
}

// Status lists the tenants this replica knows of, the most charged first,
// at most MetricTenants of them (the status document stays bounded).
func (l *Ledger) Status() []Status {
	l.mu.Lock()
	defer l.mu.Unlock()
	models := map[string]bool{}
	for k := range l.local {
		models[k.model] = true
	}
	for _, rs := range l.remote {
		for k := range rs {
			models[k.model] = true
		}
	}
	var out []Status
	for _, m := range slices.Sorted(maps.Keys(models)) {
		for _, k := range l.keysLocked(m) {
			used, _ := l.fleetLocked(k)
			st := Status{Model: k.model, Tenant: k.tenant, Tokens: used, Virtual: l.virtualLocked(k)}
			if t, ok := l.local[k]; ok {
				n, _ := t.waitingTotal()
				st.Waiting, st.Inflight, st.Here = n, t.inflight, t.used
			}
			for _, rs := range l.remote {
				st.Waiting += rs[k].Waiting
				st.Inflight += rs[k].Inflight
			}
			out = append(out, st)
		}
	}
	slices.SortStableFunc(out, func(a, b Status) int { return cmp.Compare(b.Tokens, a.Tokens) })
	return out[:min(len(out), l.cfg.MetricTenants)]
}

// Series is the metric label of a tenant (bounded: MetricTenants).
func (l *Ledger) Series(model, tenant string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	t, _ := l.localLocked(tenantKey{model, tenant})
	return t.series
}

// tokenMinute counts tokens over the last minute in one-second buckets.
type tokenMinute struct {
	at     [60]int64 // the unix second each bucket holds
	tokens [60]int64
}

func (m *tokenMinute) add(now time.Time, n int64) {
	s := now.Unix()
	i := s % 60
	if m.at[i] != s {
		m.at[i], m.tokens[i] = s, 0
	}
	m.tokens[i] += n
}

// sum is the tokens of the last 60 seconds.
func (m *tokenMinute) sum(now time.Time) int64 {
	s := now.Unix()
	var n int64
	for i := range m.at {
		if s-m.at[i] < 60 {
			n += m.tokens[i]
		}
	}
	return n
}

// until is how long until at least excess tokens have left the window.
func (m *tokenMinute) until(now time.Time, excess int64) time.Duration {
	s := now.Unix()
	for age := int64(59); age >= 0; age-- {
		at := s - age
		if i := at % 60; m.at[i] == at {
			if excess -= m.tokens[i]; excess <= 0 {
				return time.Duration(60-age) * time.Second
			}
		}
	}
	return time.Minute
}

// Hold reports whether a queue head of tenant in class, with capacity
// free, holds back now for a request waiting on another replica (YieldTo).
// since is when this head began holding (zero: it was not; Hold sets it).
// A head holds back at most MaxYield in all: a legitimate waiter elsewhere
// is admitted there within a wake, so a longer wait means a report that no
// longer holds (or a peer that cannot admit), and capacity must not stay
// idle for it; expired reports such a hold ending (the head goes).
func (l *Ledger) Hold(model, tenant string, class uint32, since *time.Time) (hold, expired bool) {
	if _, yield := l.YieldTo(model, tenant, class); !yield {
		return false, false
	}
	now := l.cfg.Now()
	if since.IsZero() {
		*since = now
	}
	if now.Sub(*since) > l.cfg.MaxYield {
		return false, true
	}
	return true, false
}

// Window is the share of each worker's admission window (the queue
// threshold) a request of tenant may fill, with Config.Headroom (else 1):
// 1 while no other tenant is
// active fleet-wide, or while tenant is not above the least served active
// tenant by more than Slack (it is not over its share); else 1/n, n the
// active tenants, itself included. The queue orders who is admitted next,
// but what a worker was given it serves first come, first served: a tenant
// over its share that fills every worker's window makes a request of a
// tenant below its share, first in the queue, wait behind a full batch
// anyway. Holding it to its share of the window keeps the rest free for the
// others, at the price of smaller batches (less throughput) while they are
// active.
func (l *Ledger) Window(model, tenant string) float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	k := tenantKey{model, tenant}
	w := l.rampLocked(k, l.cfg.Now())
	if !l.cfg.Headroom {
		return w
	}
	over, n := l.overLocked(k)
	if !over {
		return w
	}
	return min(w, 1/float64(n))
}

// overLocked reports whether a tenant is over its share: another tenant is
// active fleet-wide and this one's counter is more than Slack above the
// least served of them (Window's and EnginePriority's rule, the yield
// rule's Slack). n is the active tenants, this one included. mu must be
// held.
func (l *Ledger) overLocked(k tenantKey) (over bool, n int) {
	low := math.Inf(1)
	n = 1
	for _, o := range l.keysLocked(k.model) {
		if o != k && l.activeLocked(o) {
			low, n = min(low, l.virtualLocked(o)), n+1
		}
	}
	return n > 1 && l.virtualLocked(k) > low+l.cfg.Slack, n
}

// Engine priority levels (EnginePriority): vLLM's and SGLang's request
// priority, lower served first.
const (
	EngineAtShare   = 0 // not over its share: first in the engine's waiting queue
	EngineOverShare = 1 // over its share while another tenant is active
)

// EnginePriority is the priority level a request of tenant should carry to
// the worker (kvrouter serve --tenant-engine-priority; the simulator's
// --tenant-engine-priority): EngineOverShare while the tenant is over its
// share (overLocked: the rule of Window and the yield rule's Slack),
// EngineAtShare otherwise. The router's queue orders what it releases; a
// worker with priority scheduling then serves a tenant under its share
// before the backlog an over-share tenant already put there, which a router
// cannot reach. Two levels, from the ledger's state alone: no constant to
// tune.
func (l *Ledger) EnginePriority(model, tenant string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if over, _ := l.overLocked(tenantKey{model, tenant}); over {
		return EngineOverShare
	}
	return EngineAtShare
}

// Guard is the latency-guard factor a request of tenant is admitted under
// (Config.LatencyGuard): the factor while the tenant is over its share
// (overLocked: another tenant is active and this one's counter is more
// than Slack above the least served one's), else 0, not guarded. A tenant
// at or under its share is never held by the guard, so the capacity the
// guard keeps idle is kept for it. While tenant isolation reserves workers
// (Isolation), its rule says who is over instead, and the over-share
// tenant is guarded only where MayHold would hold it: the counters put
// the flood, served less while kept off the reserved workers, under its
// share, so by them the guard held nobody but the steady tenant (kvbench
// sim, 2026-12-06; BENCHMARKS.md, "Isolation with the guard").
func (l *Ledger) Guard(model, tenant string) float64 {
	if l.cfg.LatencyGuard == 0 {
		return 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if n := l.isoWorkers[model]; n >= 2 {
		if k, over := l.isolationLocked(model, tenant, n); k > 0 {
			// While isolation reserves workers its rule says who is
			// over, and the over-share tenant is guarded when it may be
			// held (mayHoldLocked: never the head in front of another).
			if over && l.mayHoldLocked(tenantKey{model, tenant}) {
				return l.cfg.LatencyGuard
			}
			return 0
		}
	}
	if over, _ := l.overLocked(tenantKey{model, tenant}); over {
		return l.cfg.LatencyGuard
	}
	return 0
}
