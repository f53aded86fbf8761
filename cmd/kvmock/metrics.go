package main

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/engine"
)

// statsDoc is GET /stats.
type statsDoc struct {
	ID           string        `json:"id"`
	Model        string        `json:"model"`
	Role         string        `json:"role"`
	URL          string        `json:"url"`
	UptimeS      float64       `json:"uptime_s"`
	Engine       engineDoc     `json:"engine"`
	Requests     requestsDoc   `json:"requests"`
	Events       eventsDoc     `json:"events"`
	Registration *registerDoc  `json:"registration,omitempty"`
	Config       engineCfgDoc  `json:"config"`
	Publisher    *publisherDoc `json:"publisher,omitempty"`
	KVTransfer   kvTransferDoc `json:"kv_transfer"`
	HostTier     *hostTierDoc  `json:"host_tier,omitempty"` // --host-tier-blocks > 0
	Forwarded    forwardedDoc  `json:"forwarded"`           // identity headers seen on /v1/* (apikey.go)
}

// kvTransferDoc: disaggregation. The sender side (a prefill worker's
// transfers and its link) and the receiver side (a decode worker's pulls).
type kvTransferDoc struct {
	BytesPerToken    int64   `json:"bytes_per_token"`
	LinkMBps         float64 `json:"link_mbps"` // 0 = infinite
	LinkMaxTransfers int     `json:"link_max_transfers"`
	// Sender.
	Offered   uint64 `json:"offered"`    // prefill answers carrying kv_transfer_params
	Pending   int    `json:"pending"`    // offered, not yet pulled or expired
	Expired   uint64 `json:"expired"`    // never pulled
	Unknown   uint64 `json:"unknown"`    // pulls of an unknown, expired or already pulled id (404)
	Sent      uint64 `json:"sent"`       // pulls answered
	SentBytes uint64 `json:"sent_bytes"` // simulated bytes of those
	Cancelled uint64 `json:"cancelled"`  // pulls abandoned by the puller mid-transfer
	InFlight  int64  `json:"in_flight"`  // on the link or queued for it
	PeakLink  int    `json:"peak_link"`  // most transfers moving bytes at once
	// Receiver.
	Pulls        uint64  `json:"pulls"`
	PullFailures uint64  `json:"pull_failures"` // answered 502 kv_transfer_failed
	PulledTokens uint64  `json:"pulled_tokens"`
	PullSeconds  float64 `json:"pull_seconds"` // total wall time spent pulling
	// ReceivedTokens is the engine's count of prompt tokens whose KV arrived.
	ReceivedTokens uint64 `json:"received_tokens"`
	AwaitingKV     int    `json:"awaiting_kv"` // requests holding blocks while their KV is pulled
}

// hostTierDoc: the CPU offload tier (hosttier.go).
type hostTierDoc struct {
	CapacityBlocks int    `json:"capacity_blocks"`
	Blocks         int64  `json:"blocks"`           // held now
	Offloaded      uint64 `json:"offloaded_blocks"` // GPU evictions moved here
	Evicted        uint64 `json:"evicted_blocks"`   // dropped by the host LRU
	Hits           uint64 `json:"hit_blocks"`       // blocks found by the engine's lookups
	LoadedTokens   uint64 `json:"loaded_tokens"`    // prompt tokens loaded back instead of computed
}

type engineCfgDoc struct {
	BlockSize        int     `json:"block_size"`
	KVBlocks         int     `json:"kv_blocks"`
	MaxBatchedTokens int     `json:"max_batched_tokens"`
	MaxRunning       int     `json:"max_running"`
	MaxModelLen      int     `json:"max_model_len"`
	Profile          string  `json:"profile"`
	Speedup          float64 `json:"speedup"`
	ChatTemplate     string  `json:"chat_template"`
}

type engineDoc struct {
	VirtualTimeS   float64 `json:"virtual_time_s"`
	Running        int     `json:"running"`
	Waiting        int     `json:"waiting"`
	CapacityBlocks int     `json:"capacity_blocks"`
	UsedBlocks     int     `json:"used_blocks"`
	FreeBlocks     int     `json:"free_blocks"`
	CachedBlocks   int     `json:"cached_blocks"`
	Fill           float64 `json:"fill"`
	Submitted      uint64  `json:"submitted"`
	Finished       uint64  `json:"finished"`
	Cancelled      uint64  `json:"cancelled"`
	Preemptions    uint64  `json:"preemptions"`
	Steps          uint64  `json:"steps"`
	PromptTokens   uint64  `json:"prompt_tokens"`
	CachedTokens   uint64  `json:"cached_tokens"`
	PrefillTokens  uint64  `json:"prefill_tokens"`
	OutputTokens   uint64  `json:"output_tokens"`
	StoredBlocks   uint64  `json:"stored_blocks"`
	EvictedBlocks  uint64  `json:"evicted_blocks"`
	Events         uint64  `json:"events"`
	BusyS          float64 `json:"busy_s"`
}

func toEngineDoc(s engine.Stats) engineDoc {
	return engineDoc{
		VirtualTimeS: s.Now.Seconds(), Running: s.Running, Waiting: s.Waiting,
		CapacityBlocks: s.CapacityBlocks, UsedBlocks: s.UsedBlocks, FreeBlocks: s.FreeBlocks, CachedBlocks: s.CachedBlocks,
		Fill: s.Fill, Submitted: s.Submitted, Finished: s.Finished, Cancelled: s.Cancelled, Preemptions: s.Preemptions,
		Steps: s.Steps, PromptTokens: s.PromptTokens, CachedTokens: s.CachedTokens, PrefillTokens: s.PrefillTokens,
		OutputTokens: s.OutputTokens, StoredBlocks: s.StoredBlocks, EvictedBlocks: s.EvictedBlocks, Events: s.Events,
		BusyS: s.BusyTime.Seconds(),
	}
}

type requestsDoc struct {
	Chat         uint64 `json:"chat"`
	Completions  uint64 `json:"completions"`
	Streams      uint64 `json:"streams"`
	Completed    uint64 `json:"completed"`
	Cancelled    uint64 `json:"cancelled"`
	BadRequests  uint64 `json:"bad_requests"`
	ServerErrors uint64 `json:"server_errors"`
	Unauthorized uint64 `json:"unauthorized"` // refused for want of the --api-key bearer
	// DPRankMissing, DPRankUnknown: refused for naming no rank, or one not
	// served (--dp-ranks; dp.go).
	DPRankMissing uint64 `json:"dp_rank_missing"`
	DPRankUnknown uint64 `json:"dp_rank_unknown"`
	InFlight      int64  `json:"in_flight"`
	PromptTokens  uint64 `json:"prompt_tokens"`
	CachedTokens  uint64 `json:"cached_tokens"`
	OutputTokens  uint64 `json:"output_tokens"`
}

// eventsDoc: the KV event pipeline. Every engine event is either queued,
// published, superseded by a full-state snapshot, or (no bus) dropped.
type eventsDoc struct {
	Enabled       bool   `json:"enabled"`
	Connected     bool   `json:"connected"`
	EngineEvents  uint64 `json:"engine_events"`
	Queued        int    `json:"queued"`
	QueueLimit    int    `json:"queue_limit"`
	Enqueued      uint64 `json:"enqueued"`
	Published     uint64 `json:"published"`
	Superseded    uint64 `json:"superseded"`
	Snapshots     uint64 `json:"snapshots"`
	Overflows     uint64 `json:"overflows"`
	PublishErrors uint64 `json:"publish_errors"`
	Lost          uint64 `json:"lost"`
	Duplicates    uint64 `json:"duplicates"`
	Unconfirmed   uint64 `json:"unconfirmed"`
	DroppedNoBus  uint64 `json:"dropped_no_bus"`
}

type publisherDoc struct {
	NextEventID uint64 `json:"next_event_id"`
	Published   uint64 `json:"published"`
	Acked       uint64 `json:"acked"`
	Duplicates  uint64 `json:"duplicates"`
	Retries     uint64 `json:"retries"`
	Failed      uint64 `json:"failed"`
	InFlight    int    `json:"in_flight"`
}

type registerDoc struct {
	Registered bool     `json:"registered"`
	Renewals   uint64   `json:"renewals"`
	Failures   uint64   `json:"failures"`
	URLs       []string `json:"urls"`
}

func (m *Mock) statsDoc(ctx context.Context) (statsDoc, error) {
	st, err := m.drv.stats(ctx)
	if err != nil {
		return statsDoc{}, err
	}
	c := &m.ctr
	d := statsDoc{
		ID: m.cfg.ID, Model: m.cfg.Model, Role: string(m.cfg.Role), URL: m.advertise, UptimeS: time.Since(m.started).Seconds(),
		Engine: toEngineDoc(st),
		Requests: requestsDoc{
			Chat: c.chat.Load(), Completions: c.completions.Load(), Streams: c.streams.Load(),
			Completed: c.completed.Load(), Cancelled: c.cancelled.Load(), BadRequests: c.badRequests.Load(),
			ServerErrors: c.serverErrors.Load(), Unauthorized: c.unauthorized.Load(), InFlight: c.inflight.Load(),
			DPRankMissing: m.rankCtr.missing.Load(), DPRankUnknown: m.rankCtr.unknown.Load(),
			PromptTokens: c.promptTokens.Load(), CachedTokens: c.cachedTokens.Load(), OutputTokens: c.outputToks.Load(),
		},
		Events: eventsDoc{EngineEvents: m.drv.engineEvents.Load(), DroppedNoBus: m.drv.droppedNoBus.Load()},
		Config: engineCfgDoc{
			BlockSize: m.engCfg.BlockSize, KVBlocks: m.engCfg.CapacityBlocks, MaxBatchedTokens: m.engCfg.MaxBatchedTokens,
			MaxRunning: m.engCfg.MaxRunning, MaxModelLen: m.engCfg.MaxModelLen, Profile: m.profile, Speedup: m.engCfg.Speedup,
			ChatTemplate: m.cfg.ChatTemplate.String(),
		},
	}
	d.Forwarded = m.fwd.doc()
	ts, l, pc := m.transfers, m.link, &m.pullCtr
	d.KVTransfer = kvTransferDoc{
		BytesPerToken: m.cfg.KVBytesPerToken, LinkMBps: m.cfg.LinkMBps, LinkMaxTransfers: m.cfg.LinkMaxTransfers,
		Offered: ts.offered.Load(), Pending: ts.pending(), Expired: ts.expired.Load(), Unknown: ts.unknown.Load(),
		Sent: l.sent.Load(), SentBytes: l.bytes.Load(), Cancelled: l.cancelled.Load(), InFlight: l.inflight.Load(), PeakLink: l.peak(),
		Pulls: pc.pulls.Load(), PullFailures: pc.failures.Load(), PulledTokens: pc.tokens.Load(),
		PullSeconds: time.Duration(pc.nanos.Load()).Seconds(), ReceivedTokens: st.ReceivedTokens, AwaitingKV: st.AwaitingKV,
	}
	if h := m.drv.host; h != nil {
		d.HostTier = &hostTierDoc{CapacityBlocks: h.capacity, Blocks: h.held.Load(), Offloaded: h.stored.Load(),
			Evicted: h.evicted.Load(), Hits: h.hits.Load(), LoadedTokens: st.LoadedTokens}
	}
	if q := m.q; q != nil {
		d.Events.Enabled = true
		d.Events.Queued, d.Events.QueueLimit = q.len(), q.max
		d.Events.Enqueued, d.Events.Published = q.enqueued.Load(), q.published.Load()
		d.Events.Superseded, d.Events.Snapshots, d.Events.Overflows = q.superseded.Load(), q.snapshots.Load(), q.overflows.Load()
		d.Events.PublishErrors, d.Events.Lost = q.publishErrors.Load(), q.lost.Load()
		d.Events.Duplicates, d.Events.Unconfirmed = q.duplicates.Load(), q.unconfirmed.Load()
	}
	if pub := m.publisher(); pub != nil {
		d.Events.Connected = true
		ps := pub.Stats()
		d.Publisher = &publisherDoc{NextEventID: pub.NextEventID(), Published: ps.Published, Acked: ps.Acked,
			Duplicates: ps.Duplicates, Retries: ps.Retries, Failed: ps.Failed, InFlight: ps.InFlight}
	}
	if r := m.reg; r != nil {
		st := r.Stats()
		d.Registration = &registerDoc{Registered: st.Registered, Renewals: st.Renewals, Failures: st.Failures, URLs: r.URLs()}
	}
	return d, nil
}

func (m *Mock) stats(w http.ResponseWriter, r *http.Request) {
	d, err := m.statsDoc(r.Context())
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, "server_error", "", err.Error())
		return
	}
	writeJSON(w, http.StatusOK, d)
}

// metrics writes the stats in the Prometheus text format.
func (m *Mock) metrics(w http.ResponseWriter, r *http.Request) {
	d, err := m.statsDoc(r.Context())
	if err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	var b strings.Builder
	labels := fmt.Sprintf(`worker=%q,model=%q`, d.ID, d.Model)
	metric := func(name, typ, help string, v any) {
		fmt.Fprintf(&b, "# HELP kvmock_%s %s\n# TYPE kvmock_%s %s\nkvmock_%s{%s} %v\n", name, help, name, typ, name, labels, v)
	}
	e, q, ev := d.Engine, d.Requests, d.Events
	metric("requests_total", "counter", "Inference requests received (chat and completions).", q.Chat+q.Completions)
	metric("requests_completed_total", "counter", "Requests answered in full.", q.Completed)
	metric("requests_cancelled_total", "counter", "Requests abandoned by their client.", q.Cancelled)
	metric("requests_bad_total", "counter", "Requests rejected as invalid.", q.BadRequests)
	metric("dp_rank_refused_total", "counter", "Requests refused for naming no data-parallel rank or one not served (--dp-ranks).", q.DPRankMissing+q.DPRankUnknown)
	metric("unauthorized_requests_total", "counter", "Requests to /v1/* refused with 401 for want of the --api-key bearer token.", q.Unauthorized)
	metric("requests_in_flight", "gauge", "Requests being served.", q.InFlight)
	metric("prompt_tokens_total", "counter", "Prompt tokens of completed requests.", q.PromptTokens)
	metric("cached_tokens_total", "counter", "Prompt tokens served from the prefix cache (completed requests).", q.CachedTokens)
	metric("output_tokens_total", "counter", "Output tokens of completed requests.", q.OutputTokens)
	metric("engine_running", "gauge", "Running sequences.", e.Running)
	metric("engine_waiting", "gauge", "Waiting sequences.", e.Waiting)
	metric("kv_capacity_blocks", "gauge", "KV cache capacity in blocks.", e.CapacityBlocks)
	metric("kv_used_blocks", "gauge", "KV blocks held by running requests.", e.UsedBlocks)
	metric("kv_cached_blocks", "gauge", "KV blocks holding a cached prefix.", e.CachedBlocks)
	metric("kv_fill", "gauge", "Used blocks / capacity.", e.Fill)
	metric("engine_preemptions_total", "counter", "Preemptions.", e.Preemptions)
	metric("engine_evicted_blocks_total", "counter", "Blocks evicted from the prefix cache.", e.EvictedBlocks)
	metric("kv_events_total", "counter", "KV events produced by the engine.", ev.EngineEvents)
	metric("kv_events_queued", "gauge", "KV events waiting for the publisher.", ev.Queued)
	metric("kv_events_published_total", "counter", "KV events handed to the publisher.", ev.Published)
	metric("kv_events_superseded_total", "counter", "Unpublished KV events replaced by a full-state snapshot.", ev.Superseded)
	metric("kv_snapshots_total", "counter", "Full-state republications (startup, resync, overflow, loss).", ev.Snapshots)
	metric("kv_event_queue_overflows_total", "counter", "Times the event queue filled up.", ev.Overflows)
	metric("kv_event_publish_errors_total", "counter", "Failed publish attempts (retried).", ev.PublishErrors)
	metric("kv_events_lost_total", "counter", "Events the publisher gave up on.", ev.Lost)
	metric("kv_event_duplicate_acks_total", "counter", "Events the stream acknowledged as duplicates.", ev.Duplicates)
	metric("kv_events_dropped_no_bus_total", "counter", "Events dropped because no --nats is configured.", ev.DroppedNoBus)
	kt := d.KVTransfer
	metric("kv_transfers_offered_total", "counter", "Prefill answers that offered their KV for a remote decode.", kt.Offered)
	metric("kv_transfers_pending", "gauge", "Offered KV transfers not yet pulled or expired.", kt.Pending)
	metric("kv_transfers_expired_total", "counter", "Offered KV transfers never pulled.", kt.Expired)
	metric("kv_transfers_unknown_total", "counter", "Pulls of an unknown, expired or already pulled transfer id.", kt.Unknown)
	metric("kv_transfers_total", "counter", "KV transfers sent over the link (pulls answered).", kt.Sent)
	metric("kv_transfer_bytes_total", "counter", "Simulated KV bytes sent over the link.", kt.SentBytes)
	metric("kv_transfers_cancelled_total", "counter", "KV transfers abandoned by the puller mid-transfer.", kt.Cancelled)
	metric("kv_transfers_in_flight", "gauge", "KV transfers on the link or queued for it.", kt.InFlight)
	metric("kv_pulls_total", "counter", "KV pulls from prefill workers that succeeded (decode role).", kt.Pulls)
	metric("kv_pull_failures_total", "counter", "KV pulls that failed (answered 502 kv_transfer_failed).", kt.PullFailures)
	metric("kv_pulled_tokens_total", "counter", "Prompt tokens whose KV was pulled from prefill workers.", kt.PulledTokens)
	metric("kv_pull_seconds_total", "counter", "Wall time spent pulling KV from prefill workers.", kt.PullSeconds)
	metric("kv_awaiting_requests", "gauge", "Requests holding KV blocks while their KV is pulled.", kt.AwaitingKV)
	if h := d.HostTier; h != nil {
		metric("host_tier_capacity_blocks", "gauge", "CPU offload tier capacity in blocks (--host-tier-blocks).", h.CapacityBlocks)
		metric("host_tier_blocks", "gauge", "Blocks the CPU offload tier holds.", h.Blocks)
		metric("host_tier_offloaded_blocks_total", "counter", "Blocks evicted from the GPU cache and moved to the CPU offload tier.", h.Offloaded)
		metric("host_tier_evicted_blocks_total", "counter", "Blocks dropped by the CPU offload tier's LRU.", h.Evicted)
		metric("host_tier_loaded_tokens_total", "counter", "Prompt tokens loaded back from the CPU offload tier instead of computed.", h.LoadedTokens)
	}
	if p := d.Publisher; p != nil {
		metric("kv_events_acked_total", "counter", "KV events acknowledged by the stream.", p.Acked)
		metric("kv_event_retries_total", "counter", "Re-sends with the same Nats-Msg-Id.", p.Retries)
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = w.Write([]byte(b.String()))
}
