package tenant

import (
	"cmp"
	"math"
	"slices"
	"time"
)

// Tenant isolation (Config.Isolation, kvrouter serve --tenant-isolation S,
// kvbench sim --tenant-isolation S): while a tenant is over its share, k
// of a model's workers are reserved for the tenants under theirs. A
// request of an over-share tenant is kept off the reserved workers (it
// waits in the queue while every other worker is full); a request of
// another tenant prefers them (it goes to one while one has room, else
// anywhere by cost). The latency guard judges a worker by what the router
// can predict; a reserved worker runs no step of the flood at all, so what
// the engine does beside it (its prefill chunks in the same step, its
// decode batch) is not there to predict.
//
// Who is over its share here is who the fleet serves least of what it
// asks: a tenant with more requests queued over the fleet (this replica's
// queue and the other replicas' last reports) than the least queued active
// tenant; the least queued are under their share (their demand is met, or
// met best). The flood's queue runs to thousands; a steady tenant's is
// empty or a burst of a few. Tried and dropped (prefill-heavy simulator,
// seed 1, one router): the fair queue's counters, which lift a tenant
// coming back to the others' level (Burst), so a steady tenant using 40 %
// of the fleet reads as at its share whenever its in-flight charges catch
// up (the flood read as within its share at 84 % of its routings, its
// prefills landing on the reserved workers: steady p99 6.6× alone); shares
// of the recent tokens, which isolation itself evens out (the flood held
// off the reserved workers is served about as much as the steady tenant,
// and is released onto them again); "has a request queued" alone, which
// switches isolation off whenever the steady tenant queues for a moment
// (7.1×); and a backlog at least a second old, which leaves the flood on
// the reserved workers for the first second (decode-heavy 2.5×, against
// 1.3× with the queued counts). With every active tenant queued alike, or
// the least queued with more requests
// queued than the model has workers (backlogged itself, not a burst of a
// few), nothing is reserved: the fair queue divides the fleet. Without
// that bound the prefill-heavy share runs (both tenants backlogged) gave
// the steady tenant 0.30–0.47 of the tokens instead of 0.50: the flood,
// admitted past a steady head it must not hold, piled its requests into the
// unreserved worker's engine, each charged at routing. (MayHold says when
// such a request may be held at all.)
//
// Every replica computes the same set without a word to the others:
//
//	k = ⌈ n · S · U ÷ A ⌉, clamped to [1, n−1]
//	    n: the model's workers; S: the safety factor (≥ 1);
//	    U: the under-share tenants' tokens charged fleet-wide over the last
//	       RecentWindow (uncached prompt + output, the fairness counters'
//	       unit: this replica's charges and the growth of every other
//	       replica's reports), their demand, since the fleet meets it;
//	    A: every active tenant's tokens over the same window.
//	k = 0 while the model has one active tenant, none is over its share,
//	    or the least queued one is backlogged itself (above).
//	    Active here: a request waiting or in flight, or tokens charged in
//	    the last RecentWindow (so isolation outlasts a tenant's gaps between
//	    requests, and ends RecentWindow after its last).
//
// The set is the first k workers in rendezvous order (ReservedWorkers: the
// highest hash of model and worker id), a function of the worker ids
// alone: the same on every replica, independent of the order a replica
// lists them in, and nested (the set for k is in the set for k+1), so a k
// that moves by one moves one worker, and a worker's departure moves only
// its own slot. Cache: the set is not chosen by where the under-share
// tenants' prefixes are now; they follow it. Their requests go to the
// reserved workers, which then hold their prefixes, and the flood, kept
// off them, no longer evicts those; a set chosen from the index would
// differ between replicas by the index's event lag and flip with each
// eviction, moving the prefixes it was meant to keep.
//
// The clamp to n−1 keeps one worker for the over-share tenant, because U ÷
// A feeds back: the flood held off k workers is charged less, U ÷ A grows,
// and so does k. Without the clamp the fixed point of x = k ÷ n solves
// x (u + 1 − x) = u S (u: the under-share tenants' demand as a fraction of
// the fleet); for S = 1.5 it exists only for u ≤ 0.27, above that k would
// climb to n.

// RecentWindow is how far back the demand share looks; recentBucket its
// resolution.
const (
	RecentWindow = 5 * time.Second
	recentBucket = 250 * time.Millisecond
	recentN      = int(RecentWindow / recentBucket)
)

// recentTokens counts tokens over the last RecentWindow in buckets aligned
// to the clock (every replica's buckets cover the same instants).
type recentTokens struct {
	at     [recentN]int64 // the bucket number each slot holds
	tokens [recentN]uint64
	since  time.Time // when its current run of activity began (rampLocked)
}

func (r *recentTokens) add(now time.Time, n uint64) {
	if r.sum(now) == 0 {
		r.since = now
	}
	b := now.UnixNano() / int64(recentBucket)
	i := b % int64(recentN)
	if r.at[i] != b {
		r.at[i], r.tokens[i] = b, 0
	}
	r.tokens[i] += n
}

func (r *recentTokens) sum(now time.Time) uint64 {
	b := now.UnixNano() / int64(recentBucket)
	var n uint64
	for i := range r.at {
		if b-r.at[i] < int64(recentN) && r.at[i] <= b {
			n += r.tokens[i]
		}
	}
	return n
}

// ValidateIsolation refuses a safety factor that is not 0 (off) or a
// finite number of at least 1.
func ValidateIsolation(s float64) bool {
	return s == 0 || (s >= 1 && !math.IsInf(s, 1))
}

// recentLocked adds n tokens to a tenant's fleet-wide recent count. mu
// must be held.
func (l *Ledger) recentLocked(k tenantKey, now time.Time, n uint64) {
	if l.cfg.Isolation == 0 || n == 0 {
		return
	}
	r, ok := l.recent[k]
	if !ok {
		if len(l.recent) >= 4*l.cfg.MaxTenants {
			return // bounded as the ledger is; a forgotten tenant frees its slot
		}
		r = &recentTokens{}
		l.recent[k] = r
	}
	r.add(now, n)
}

// Recent is a tenant's tokens charged fleet-wide over the last
// RecentWindow as this replica knows them (with Config.Isolation; tests,
// diagnostics).
func (l *Ledger) Recent(model, tenant string) uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if r, ok := l.recent[tenantKey{model, tenant}]; ok {
		return r.sum(l.cfg.Now())
	}
	return 0
}

// MayHold reports whether isolation may hold a request of tenant (over
// its share by Isolation's rule) in this replica's queue: while the fair
// queue's counters also put it over its share (overLocked, the rule of
// Window and Guard; the queue then serves the others first), or while no
// other tenant has a request queued here. The queue serves the tenant with
// the smallest counter first, so a tenant the counters do not put over may
// be the head, and holding the head would hold every request behind it;
// with nobody behind it, holding it costs nobody, and keeps its backlog in
// the queue rather than in the unreserved workers' engines.
func (l *Ledger) MayHold(model, tenant string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.mayHoldLocked(tenantKey{model, tenant})
}

// mayHoldLocked is MayHold's rule. mu must be held.
func (l *Ledger) mayHoldLocked(k tenantKey) bool {
	model, tenant := k.model, k.tenant
	if over, _ := l.overLocked(k); over {
		return true
	}
	for o, t := range l.local {
		if o.model == model && o.tenant != tenant {
			if n, _ := t.waitingTotal(); n > 0 {
				return false
			}
		}
	}
	return true
}

// IsolationPasses reports whether a request of tenant, arriving at this
// replica with room on a worker for it, may pass the requests queued here
// rather than queue behind them: isolation reserves workers (of n), the
// latency guard is on (Config.LatencyGuard: with it the over-share tenant
// waits for its workers to be quick, not only for room) and tenant is
// under its share, with no request of its own queued here. The
// queue holds the over-share tenant's backlog, waiting for its own
// workers; a request under its share that has room now is not competing
// for them. Queued behind them it waited for the queue's order, and the
// fair counters put the over-share tenant (served less, being held) first,
// whose head, with another tenant behind it, may not be held (MayHold): it
// was released past isolation and the guard, onto the workers the guard
// keeps quick (kvbench sim, 2026-12-06: a flood request released at every
// steady arrival, 3–27 of its prefills queued on its worker). Without the
// guard that release is what shares the unreserved worker's room between
// the tenants, and passing changed the isolation-only figures for the
// worse (prefill-heavy, three routers, 1.37× → 1.53× alone): off there.
func (l *Ledger) IsolationPasses(model, tenant string, n int) bool {
	if l.cfg.Isolation == 0 || l.cfg.LatencyGuard == 0 || n < 2 {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.noteWorkersLocked(model, n)
	if t, ok := l.local[tenantKey{model, tenant}]; ok {
		if w, _ := t.waitingTotal(); w > 0 {
			return false
		}
	}
	k, over := l.isolationLocked(model, tenant, n)
	return k > 0 && !over
}

// Isolation is the rule's answer for a request of tenant on a model of n
// workers: k, how many workers are reserved for the tenants under their
// share (0: none), and over, whether tenant is over its share (its request
// is kept off them; otherwise it prefers them).
func (l *Ledger) Isolation(model, tenant string, n int) (k int, over bool) {
	if l.cfg.Isolation == 0 || n < 2 {
		return 0, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.noteWorkersLocked(model, n)
	return l.isolationLocked(model, tenant, n)
}

// noteWorkersLocked keeps model's worker count for Guard, which applies
// the isolation rule without being told it. mu must be held.
func (l *Ledger) noteWorkersLocked(model string, n int) {
	if l.isoWorkers[model] != n {
		if len(l.isoWorkers) >= 4*l.cfg.MaxTenants {
			clear(l.isoWorkers) // bounded; the next call of each model sets it again
		}
		l.isoWorkers[model] = n
	}
}

// isolationLocked is Isolation's rule. mu must be held.
func (l *Ledger) isolationLocked(model, tenant string, n int) (k int, over bool) {
	now := l.cfg.Now()
	type demand struct {
		k      tenantKey
		recent uint64
		queued int
	}
	var active []demand
	least := math.MaxInt
	for _, o := range l.keysLocked(model) {
		d := demand{k: o, queued: l.queuedLocked(o)}
		if r, ok := l.recent[o]; ok {
			d.recent = r.sum(now)
		}
		if d.recent == 0 && !l.activeLocked(o) {
			// Neither sending nor charged lately. A tenant between two
			// requests still counts: a steady tenant with short requests
			// is idle a third of the time (prefill-heavy simulator), and
			// each gap would let the flood onto the reserved workers.
			continue
		}
		active = append(active, d)
		least = min(least, d.queued)
	}
	// Whether the least queued tenants are past their start (BacklogAge):
	// a queue in a tenant's first BacklogAge of activity is its cold start,
	// not a backlog.
	settled := false
	for _, d := range active {
		if d.queued == least {
			r, ok := l.recent[d.k]
			settled = settled || !ok || now.Sub(r.since) >= BacklogAge
		}
	}
	var under, all uint64
	anyOver := false
	for _, d := range active {
		all += d.recent
		ov := d.queued > least
		if d.k.tenant == tenant {
			over = ov
		}
		if ov {
			anyOver = true
		} else {
			under += d.recent
		}
	}
	if len(active) < 2 || !anyOver || (least > n && settled) {
		// least > n: the least queued tenant is backlogged itself (more
		// than a request per worker waiting), not a tenant whose demand
		// the fleet meets; the fair queue alone divides the fleet.
		return 0, false
	}
	share := 0.0
	if all > 0 {
		share = float64(under) / float64(all)
	}
	k = int(math.Ceil(float64(n) * l.cfg.Isolation * share))
	return min(max(k, 1), n-1), over
}

// BacklogAge is how long after a tenant's activity begins Isolation may
// read its queue as a backlog of its own (more than a request per worker
// queued: then nothing is reserved). At a run's start every worker is busy
// with cold prompts and the steady tenant queues a few requests for a few
// hundred milliseconds (kvbench sim, decode-heavy seed 3: up to 6 queued,
// for 0.3 s); read as backlogged, isolation switched off exactly then and
// the fair queue released the flood onto every worker beside it. Counted
// from the start of its activity, not of its queue: a tenant backlogged
// in earnest empties its queue now and then (prefill-heavy share runs), and
// a 1 s age on the queue itself kept isolation on through those and gave
// the steady tenant 0.29–0.35 of the tokens.
const BacklogAge = time.Second

// queuedLocked is a tenant's requests queued over the fleet (here, and in
// every other replica's last report). mu must be held.
func (l *Ledger) queuedLocked(k tenantKey) int {
	n := 0
	if t, ok := l.local[k]; ok {
		n, _ = t.waitingTotal()
	}
	for _, rs := range l.remote {
		if u, ok := rs[k]; ok {
			n += u.Waiting
		}
	}
	return n
}

// ReservedWorkers appends to dst the k workers of model reserved by the
// isolation rule: the first k in rendezvous order (the highest FNV-1a hash
// of model and worker id, ties by id). It reads nothing but its arguments,
// so every replica listing the same workers reserves the same ones,
// whatever their order.
func ReservedWorkers[W ~string](model string, workers []W, k int, dst []W) []W {
	if k <= 0 || len(workers) == 0 {
		return dst
	}
	type scored struct {
		w     W
		score uint64
	}
	all := make([]scored, len(workers))
	for i, w := range workers {
		all[i] = scored{w, mix64(fnv1a(fnv1a(fnv1a(fnvOffset, model), "\x00"), string(w)))}
	}
	slices.SortFunc(all, func(a, b scored) int {
		if c := cmp.Compare(b.score, a.score); c != 0 {
			return c
		}
		return cmp.Compare(a.w, b.w)
	})
	for _, s := range all[:min(k, len(all))] {
		dst = append(dst, s.w)
	}
	return dst
}

// FNV-1a, 64 bits, inline: ReservedWorkers runs on every admission check,
// and hash/fnv's hasher would allocate there.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

func fnv1a(h uint64, s string) uint64 {
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= fnvPrime
	}
	return h
}

// mix64 is splitmix64's finaliser: FNV's low bits alone spread short ids
// with a common prefix (w0, w1, …) poorly.
// (internal/splitmix.Mix's twin: this package depends on the standard
// library alone.)
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// The start ramp (rampLocked): a tenant alone on a model gets RampShare of
// each worker's admission window for RampWindow after its activity
// begins. Isolation reserves workers only once a second tenant is active,
// and by then the first one's requests have filled every worker's window
// with cold prompts (kvbench sim, 2026-12-06: the flood's first requests,
// a few milliseconds before the steady tenant's first, on all three
// workers; the steady tenant's slow requests were the ones sent in the
// first half second, queued behind them). The ramp leaves each worker's
// window half free for whoever comes next; a tenant that stays alone loses
// nothing after RampWindow.
const (
	RampWindow = 500 * time.Millisecond
	RampShare  = 0.5
)

// rampLocked is the share of each worker's admission window tenant k gets
// now: RampShare while it is the model's only tenant with tokens charged
// lately and within RampWindow of the start of its activity, else 1. mu
// must be held.
func (l *Ledger) rampLocked(k tenantKey, now time.Time) float64 {
	if l.cfg.Isolation == 0 {
		return 1
	}
	r, ok := l.recent[k]
	if !ok || r.sum(now) == 0 || now.Sub(r.since) >= RampWindow {
		return 1
	}
	for o, ro := range l.recent {
		if o != k && o.model == k.model && ro.sum(now) > 0 {
			return 1 // not alone: isolation's rule applies
		}
	}
	return RampShare
}
