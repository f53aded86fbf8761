package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Disaggregated prefill/decode, in the shape of vLLM's NIXL connector and
// its toy proxy, so that one router works against kvmock and real vLLM:
//
//  1. prefill stage: the router sends the request with max_tokens 1,
//     stream false and kv_transfer_params {do_remote_decode: true}; a
//     prefilling worker runs it and answers with kv_transfer_params naming
//     itself and a transfer id;
//  2. decode stage: the router sends the original request with those
//     kv_transfer_params; the decoding worker pulls the KV it lacks from
//     the prefill worker (GET /kv/pull, over the prefill worker's one
//     shared link) and generates.
//
// See DESIGN.md, "Disaggregation".

// kvTransferParams is the kv_transfer_params object of a request (router
// → worker) and of a prefill answer (worker → router). The two flags are
// always written: vLLM's proxy reads them as given.
type kvTransferParams struct {
	DoRemoteDecode  bool   `json:"do_remote_decode"`
	DoRemotePrefill bool   `json:"do_remote_prefill"`
	RemoteEngineID  string `json:"remote_engine_id,omitempty"`
	RemoteHost      string `json:"remote_host,omitempty"`
	RemotePort      int    `json:"remote_port,omitempty"`
	// RemoteURL and TransferID are kvmock's: where and what to pull (vLLM
	// moves the blocks named by RemoteBlockIDs over NIXL instead).
	RemoteURL      string `json:"remote_url,omitempty"`
	TransferID     string `json:"transfer_id,omitempty"`
	NumTokens      int    `json:"num_tokens,omitempty"`
	RemoteBlockIDs []int  `json:"remote_block_ids,omitempty"`
}

// stage is what a request asks of this worker.
type stage uint8

const (
	stageAggregated stage = iota // no kv_transfer_params: prefill and decode here
	stagePrefill                 // do_remote_decode: prefill here, decode elsewhere
	stageDecode                  // do_remote_prefill: prefilled elsewhere, decode here
)

// stageOf checks kv_transfer_params against the worker's role. Any role
// serves a plain request aggregated: a prefill worker can decode and a
// decode worker can prefill, they are only told which to expect.
func (m *Mock) stageOf(kv *kvTransferParams, stream bool) (stage, error) {
	switch {
	case kv == nil || (!kv.DoRemoteDecode && !kv.DoRemotePrefill):
		return stageAggregated, nil
	case kv.DoRemoteDecode && kv.DoRemotePrefill:
		return 0, errors.New("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
	case kv.DoRemoteDecode:
		if !m.cfg.Role.Prefills() {
			return 0, fmt.Errorf("worker %s has role %s: it does not prefill for remote decode (kv_transfer_params.do_remote_decode)", m.cfg.ID, m.cfg.Role)
		}
		if stream {
			return 0, errors.New("kv_transfer_params.do_remote_decode needs stream false: the transfer parameters come in the JSON answer")
		}
		return stagePrefill, nil
	default:
		if !m.cfg.Role.Decodes() {
			return 0, fmt.Errorf("worker %s has role %s: it does not decode remotely prefilled requests (kv_transfer_params.do_remote_prefill)", m.cfg.ID, m.cfg.Role)
		}
		if kv.TransferID == "" || kv.pullBase() == "" {
			return 0, errors.New("kv_transfer_params.do_remote_prefill needs transfer_id and remote_url (or remote_host and remote_port)")
		}
		return stageDecode, nil
	}
}

// pullBase is the prefill worker's base URL: remote_url, else built from
// remote_host and remote_port; "" when neither is given.
func (p *kvTransferParams) pullBase() string {
	if p.RemoteURL != "" {
		return p.RemoteURL
	}
	if p.RemoteHost != "" && p.RemotePort > 0 {
		return "http://" + net.JoinHostPort(p.RemoteHost, strconv.Itoa(p.RemotePort))
	}
	return ""
}

// offerKV is the prefill stage's answer: it records the transfer (for
// --kv-transfer-ttl, or until pulled) and returns the parameters the
// decode worker needs. It runs before the answer is written, so a pull
// can never arrive before the record exists.
func (m *Mock) offerKV(reqID string, promptTokens int) *kvTransferParams {
	id := fmt.Sprintf("%s-%016x", reqID, rand.Uint64()) // unique across restarts too
	m.transfers.add(id, promptTokens, time.Now())
	p := &kvTransferParams{
		DoRemotePrefill: true,
		RemoteEngineID:  m.cfg.ID,
		RemoteURL:       m.advertise,
		TransferID:      id,
		NumTokens:       promptTokens,
	}
	if u, err := url.Parse(m.advertise); err == nil {
		p.RemoteHost = u.Hostname()
		p.RemotePort, _ = strconv.Atoi(u.Port())
		if p.RemotePort == 0 && u.Scheme == "https" {
			p.RemotePort = 443
		} else if p.RemotePort == 0 {
			p.RemotePort = 80
		}
	}
	// The prompt's block positions: vLLM names the blocks holding the KV;
	// kvmock has nothing to name, so they only say how many there are.
	n := (promptTokens + m.engCfg.BlockSize - 1) / m.engCfg.BlockSize
	p.RemoteBlockIDs = make([]int, n)
	for i := range p.RemoteBlockIDs {
		p.RemoteBlockIDs[i] = i
	}
	return p
}

// transferStore holds the prefill side's transfers until they are pulled
// or expire. Expiry is lazy (on add and lookup): records are kept in
// creation order, which is expiry order since the TTL is fixed.
type transferStore struct {
	ttl time.Duration

	mu    sync.Mutex
	recs  map[string]transferRecord // mu must be held
	order []string                  // ids, oldest first (some already pulled); mu must be held

	offered, expired, unknown atomic.Uint64
}

type transferRecord struct {
	tokens  int
	expires time.Time
}

func newTransferStore(ttl time.Duration) *transferStore {
	return &transferStore{ttl: ttl, recs: map[string]transferRecord{}}
}

func (s *transferStore) add(id string, tokens int, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(now)
	s.recs[id] = transferRecord{tokens: tokens, expires: now.Add(s.ttl)}
	s.order = append(s.order, id)
	s.offered.Add(1)
}

// take removes and returns transfer id's record if it has not expired and
// check accepts it (a record check refuses stays).
func (s *transferStore) take(id string, now time.Time, check func(transferRecord) error) (transferRecord, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(now)
	rec, ok := s.recs[id]
	if !ok {
		s.unknown.Add(1)
		return transferRecord{}, false, nil
	}
	if err := check(rec); err != nil {
		return rec, true, err
	}
	delete(s.recs, id)
	return rec, true, nil
}

// expireLocked drops the records past their expiry. mu must be held.
func (s *transferStore) expireLocked(now time.Time) {
	n := 0
	for ; n < len(s.order); n++ {
		id := s.order[n]
		rec, ok := s.recs[id]
		if ok && rec.expires.After(now) {
			break
		}
		if ok {
			delete(s.recs, id)
			s.expired.Add(1)
		}
	}
	if n > 0 {
		s.order = append(s.order[:0], s.order[n:]...)
	}
}

// putBack returns a record whose pull broke off, so the decode worker's
// retry (the router restarts a failed transfer) finds it again; it keeps its
// original expiry.
func (s *transferStore) putBack(id string, rec transferRecord) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.recs[id]; !ok {
		s.recs[id] = rec
		s.order = append(s.order, id)
	}
}

func (s *transferStore) pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.recs)
}

// pullDoc is GET /kv/pull's answer.
type pullDoc struct {
	TransferID string  `json:"transfer_id"`
	Tokens     int     `json:"tokens"`
	Bytes      int64   `json:"bytes"`
	Seconds    float64 `json:"seconds"` // on the link, queueing included (wall time: --speedup applied)
}

// kvPull serves GET /kv/pull?transfer_id=ID&tokens=N: it "sends" N tokens
// of the transfer's KV (all of them when tokens is absent) over the link
// and answers when the last byte is through. A transfer is pulled once; one
// the puller abandons can be pulled again until it expires.
func (m *Mock) kvPull(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	id := q.Get("transfer_id")
	if id == "" {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "transfer_id is required")
		return
	}
	tokens := -1
	if s := q.Get("tokens"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			writeError(w, http.StatusBadRequest, "invalid_request_error", "", fmt.Sprintf("tokens %q: want a non-negative integer", s))
			return
		}
		tokens = n
	}
	rec, ok, err := m.transfers.take(id, time.Now(), func(rec transferRecord) error {
		if tokens > rec.tokens {
			return fmt.Errorf("tokens %d: transfer %s holds %d", tokens, id, rec.tokens)
		}
		return nil
	})
	switch {
	case !ok:
		writeError(w, http.StatusNotFound, "not_found_error", "transfer_not_found", fmt.Sprintf("transfer %q is unknown, expired or already pulled", id))
		return
	case err != nil:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", err.Error())
		return
	}
	if tokens < 0 {
		tokens = rec.tokens
	}
	bytes := int64(tokens) * m.cfg.KVBytesPerToken
	took, err := m.link.send(r.Context(), id, bytes)
	switch {
	case errors.Is(err, errLinkStopped):
		writeError(w, http.StatusServiceUnavailable, "server_error", "shutting_down", "the worker is shutting down")
		return
	case err != nil: // the decode worker went away (timeout, crash): it may retry
		m.log.Debug("KV transfer abandoned by the puller", "transfer", id, "err", err)
		m.transfers.putBack(id, rec)
		return
	}
	writeJSON(w, http.StatusOK, pullDoc{TransferID: id, Tokens: tokens, Bytes: bytes, Seconds: took.Seconds()})
}

// pullCounters are the decode side's transfer totals.
type pullCounters struct {
	pulls, failures, tokens atomic.Uint64
	nanos                   atomic.Int64 // time spent pulling
}

// errKVTransfer marks a failed pull: the answer is 502 kv_transfer_failed.
var errKVTransfer = errors.New("KV transfer failed")

// pullKV fetches tokens tokens of KV from the prefill worker named by kv,
// within --kv-pull-timeout. Errors wrap errKVTransfer, or are ctx's.
func (m *Mock) pullKV(parent context.Context, kv *kvTransferParams, tokens int) (pullDoc, error) {
	base := kv.pullBase()
	ctx, cancel := context.WithTimeout(parent, m.cfg.KVPullTimeout)
	defer cancel()
	start := time.Now()
	q := url.Values{"transfer_id": {kv.TransferID}, "tokens": {strconv.Itoa(tokens)}}
	d, err := m.getPull(ctx, base+"/kv/pull?"+q.Encode())
	m.pullCtr.nanos.Add(int64(time.Since(start)))
	if err != nil {
		if parent.Err() == nil { // not a client that went away
			m.pullCtr.failures.Add(1)
		}
		return pullDoc{}, fmt.Errorf("%w: pull %d tokens of transfer %s from %s: %w", errKVTransfer, tokens, kv.TransferID, base, err)
	}
	m.pullCtr.pulls.Add(1)
	m.pullCtr.tokens.Add(uint64(tokens))
	return d, nil
}

func (m *Mock) getPull(ctx context.Context, u string) (pullDoc, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return pullDoc{}, err
	}
	resp, err := m.pullClient.Do(req)
	if err != nil {
		return pullDoc{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return pullDoc{}, fmt.Errorf("reading the answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return pullDoc{}, fmt.Errorf("HTTP %d: %.300s", resp.StatusCode, body)
	}
	var d pullDoc
	if err := json.Unmarshal(body, &d); err != nil {
		return pullDoc{}, fmt.Errorf("decoding the answer: %w", err)
	}
	return d, nil
}

// writeKVTransferFailed is the decode stage's 502, sent before any body
// byte so the router can retry the request or serve it aggregated.
func writeKVTransferFailed(w http.ResponseWriter, msg string) {
	writeJSON(w, http.StatusBadGateway, map[string]any{"error": map[string]any{
		"message": msg, "type": "kv_transfer_failed", "param": nil, "code": http.StatusBadGateway,
	}})
}
