package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvrouter/kvrouter/router"
)

// promptIDs is n distinct token ids from base: a completions prompt of
// exactly n tokens.
func promptIDs(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}

func complBody(prompt []uint32, maxTokens int, stream bool, kv any) map[string]any {
	b := map[string]any{"model": "kvmock", "prompt": prompt, "max_tokens": maxTokens, "stream": stream}
	if kv != nil {
		b["kv_transfer_params"] = kv
	}
	return b
}

// postH is post with the response headers.
func postH(t *testing.T, url string, body any) (int, http.Header, []byte) {
	t.Helper()
	return postHWith(t, http.DefaultClient, url, body)
}

// postHWith is postH with client c.
func postHWith(t *testing.T, c *http.Client, url string, body any) (int, http.Header, []byte) {
	t.Helper()
	data, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Post(url, "application/json", bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, out
}

// prefillAnswer is a prefill stage's answer as the router reads it.
type prefillAnswer struct {
	answer
	KV *kvTransferParams `json:"kv_transfer_params"`
}

// prefillStage runs the router's first stage against url.
func prefillStage(t *testing.T, url string, prompt []uint32) (prefillAnswer, []byte) {
	t.Helper()
	return prefillStageWith(t, http.DefaultClient, url, prompt)
}

// prefillStageWith is prefillStage with client c.
func prefillStageWith(t *testing.T, c *http.Client, url string, prompt []uint32) (prefillAnswer, []byte) {
	t.Helper()
	status, body := postWith(t, c, url+"/v1/completions",
		complBody(prompt, 1, false, map[string]any{"do_remote_decode": true, "do_remote_prefill": false}))
	if status != http.StatusOK {
		t.Fatalf("prefill: HTTP %d: %s", status, body)
	}
	var a prefillAnswer
	if err := json.Unmarshal(body, &a); err != nil || a.KV == nil {
		t.Fatalf("prefill answer %s: %v", body, err)
	}
	return a, body
}

// decodeResult is one decode stage as the client sees it.
type decodeResult struct {
	status             int
	body               []byte
	local, pulled      int     // X-Kvmock-Kv-*-Tokens
	linkS, wallS       float64 // the prefill side's link time; the request's time (a bubble's clock in a synctest test)
	cached, promptToks int
}

func decodeStage(t *testing.T, url string, prompt []uint32, kv *kvTransferParams, maxTokens int) decodeResult {
	t.Helper()
	return decodeStageWith(t, http.DefaultClient, url, prompt, kv, maxTokens)
}

// decodeStageWith is decodeStage with client c.
func decodeStageWith(t *testing.T, c *http.Client, url string, prompt []uint32, kv *kvTransferParams, maxTokens int) decodeResult {
	t.Helper()
	start := time.Now()
	status, h, body := postHWith(t, c, url+"/v1/completions", complBody(prompt, maxTokens, false, kv))
	r := decodeResult{status: status, body: body, wallS: time.Since(start).Seconds()}
	if status != http.StatusOK {
		return r
	}
	r.local, _ = strconv.Atoi(h.Get("X-Kvmock-Kv-Local-Tokens"))
	r.pulled, _ = strconv.Atoi(h.Get("X-Kvmock-Kv-Pulled-Tokens"))
	r.linkS, _ = strconv.ParseFloat(h.Get("X-Kvmock-Kv-Pull-Seconds"), 64)
	a := decodeAnswer(t, body)
	if a.Usage == nil || len(a.Choices) != 1 || a.Choices[0].Text == nil {
		t.Fatalf("decode answer %s", body)
	}
	r.cached, r.promptToks = a.Usage.PromptTokensDetails.CachedTokens, a.Usage.PromptTokens
	return r
}

func statsOf(t *testing.T, url string) statsDoc {
	t.Helper()
	return statsOfWith(t, http.DefaultClient, url)
}

// statsOfWith is statsOf with client c.
func statsOfWith(t *testing.T, c *http.Client, url string) statsDoc {
	t.Helper()
	status, body := getWith(t, c, url+"/stats")
	var d statsDoc
	if status != http.StatusOK || json.Unmarshal(body, &d) != nil {
		t.Fatalf("stats: HTTP %d: %s", status, body)
	}
	return d
}

func withRole(role router.Role, more ...func(*config)) func(*config) {
	return func(c *config) {
		c.Role = role
		for _, fn := range more {
			fn(c)
		}
	}
}

// The prefill stage answers the OpenAI JSON plus kv_transfer_params naming
// this worker and a transfer the decode worker can pull once.
func TestMockDisaggPrefillAnswer(t *testing.T) {
	tests := []struct {
		name   string
		role   router.Role
		prompt int
	}{
		{"prefill role, 100 tokens", router.RolePrefill, 100},
		{"both role, 33 tokens", router.RoleBoth, 33},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tm := startMock(t, withRole(tc.role), true)
			prompt := promptIDs(1000, tc.prompt)
			a, raw := prefillStage(t, tm.url, prompt)
			kv := a.KV
			port, _ := strconv.Atoi(tm.url[strings.LastIndexByte(tm.url, ':')+1:])
			if !kv.DoRemotePrefill || kv.DoRemoteDecode || kv.RemoteEngineID != "mock-1" || kv.RemoteHost != "127.0.0.1" ||
				kv.RemotePort != port || kv.RemoteURL != tm.url || kv.TransferID == "" || kv.NumTokens != tc.prompt ||
				len(kv.RemoteBlockIDs) != (tc.prompt+15)/16 {
				t.Fatalf("kv_transfer_params %+v", kv)
			}
			// Both flags are written: vLLM's proxy reads them as given.
			if !bytes.Contains(raw, []byte(`"do_remote_decode":false`)) || !bytes.Contains(raw, []byte(`"do_remote_prefill":true`)) {
				t.Fatalf("flags missing from %s", raw)
			}
			if a.Usage == nil || a.Usage.PromptTokens != tc.prompt || a.Usage.CompletionTokens != 1 || a.Usage.PromptTokensDetails.CachedTokens != 0 {
				t.Fatalf("usage %s", raw)
			}
			// The prefill ran for real: the same prompt again hits the cache,
			// and gets another transfer id.
			b, _ := prefillStage(t, tm.url, prompt)
			if want := (tc.prompt - 1) / 16 * 16; b.Usage.PromptTokensDetails.CachedTokens != want {
				t.Errorf("second prefill cached %d, want %d", b.Usage.PromptTokensDetails.CachedTokens, want)
			}
			if b.KV.TransferID == kv.TransferID {
				t.Errorf("transfer id %q reused", kv.TransferID)
			}
			// A transfer is pulled once (infinite link: at once).
			status, body := get(t, tm.url+"/kv/pull?transfer_id="+kv.TransferID)
			var d pullDoc
			if status != http.StatusOK || json.Unmarshal(body, &d) != nil || d.TransferID != kv.TransferID ||
				d.Tokens != tc.prompt || d.Bytes != int64(tc.prompt)*114688 || d.Seconds != 0 {
				t.Fatalf("pull: HTTP %d: %s", status, body)
			}
			if status, body := get(t, tm.url+"/kv/pull?transfer_id="+kv.TransferID); status != http.StatusNotFound {
				t.Fatalf("second pull: HTTP %d: %s", status, body)
			}
			st := statsOf(t, tm.url).KVTransfer
			if st.Offered != 2 || st.Sent != 1 || st.Pending != 1 || st.Unknown != 1 || st.SentBytes != uint64(tc.prompt)*114688 {
				t.Fatalf("kv_transfer stats %+v", st)
			}
			_, body = get(t, tm.url+"/metrics")
			if !strings.Contains(string(body), `kvmock_kv_transfers_total{worker="mock-1",model="kvmock"} 1`) {
				t.Fatalf("metrics:\n%s", body)
			}
		})
	}
}

// Each role accepts only its stage; every role serves plain requests.
func TestMockDisaggRoleValidation(t *testing.T) {
	remote := map[string]any{"do_remote_prefill": true, "transfer_id": "x", "remote_url": "http://127.0.0.1:1"}
	tests := []struct {
		name   string
		role   router.Role
		body   map[string]any
		status int
		msg    string // in the error message
	}{
		{"decode worker refuses to prefill", router.RoleDecode,
			complBody(promptIDs(1, 20), 1, false, map[string]any{"do_remote_decode": true}), 400, "does not prefill"},
		{"prefill worker refuses to decode", router.RolePrefill,
			complBody(promptIDs(1, 20), 4, false, remote), 400, "does not decode"},
		{"prefill worker serves plain requests", router.RolePrefill, complBody(promptIDs(1, 20), 4, false, nil), 200, ""},
		{"decode worker serves plain requests", router.RoleDecode, complBody(promptIDs(1, 20), 4, false, nil), 200, ""},
		{"both flags", router.RoleBoth,
			complBody(promptIDs(1, 20), 1, false, map[string]any{"do_remote_decode": true, "do_remote_prefill": true}), 400, "exclusive"},
		{"prefill stage must not stream", router.RoleBoth,
			complBody(promptIDs(1, 20), 1, true, map[string]any{"do_remote_decode": true}), 400, "stream false"},
		{"decode stage needs a transfer id", router.RoleDecode,
			complBody(promptIDs(1, 20), 4, false, map[string]any{"do_remote_prefill": true, "remote_url": "http://127.0.0.1:1"}), 400, "transfer_id"},
		{"decode stage needs the prefill worker", router.RoleDecode,
			complBody(promptIDs(1, 20), 4, false, map[string]any{"do_remote_prefill": true, "transfer_id": "x"}), 400, "remote_url"},
		{"decode stage of another prompt", router.RoleDecode,
			complBody(promptIDs(1, 20), 4, false, map[string]any{"do_remote_prefill": true, "transfer_id": "x", "remote_url": "http://127.0.0.1:1", "num_tokens": 21}),
			400, "num_tokens is 21"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tm := startMock(t, withRole(tc.role), true)
			status, body := post(t, tm.url+"/v1/completions", tc.body)
			if status != tc.status {
				t.Fatalf("HTTP %d, want %d: %s", status, tc.status, body)
			}
			if tc.status == 200 {
				if bytes.Contains(body, []byte("kv_transfer_params")) {
					t.Fatalf("plain answer with kv_transfer_params: %s", body)
				}
				return
			}
			var e struct {
				Error struct{ Message, Type string }
			}
			if json.Unmarshal(body, &e) != nil || e.Error.Type != "invalid_request_error" || !strings.Contains(e.Error.Message, tc.msg) {
				t.Fatalf("error %s, want one saying %q", body, tc.msg)
			}
		})
	}
	// Bad pulls.
	tm := startMock(t, withRole(router.RolePrefill), true)
	a, _ := prefillStage(t, tm.url, promptIDs(1, 40))
	id := a.KV.TransferID
	for _, c := range []struct {
		query  string
		status int
	}{
		{"", 400},
		{"transfer_id=" + id + "&tokens=abc", 400},
		{"transfer_id=" + id + "&tokens=-1", 400},
		{"transfer_id=" + id + "&tokens=41", 400}, // more than it holds: refused, the transfer stays
		{"transfer_id=nope", 404},
		{"transfer_id=" + id + "&tokens=40", 200},
		{"transfer_id=" + id + "&tokens=40", 404}, // pulled once
	} {
		if status, body := get(t, tm.url+"/kv/pull?"+c.query); status != c.status {
			t.Errorf("pull %q: HTTP %d, want %d: %s", c.query, status, c.status, body)
		}
	}
}

// A transfer expires after --kv-transfer-ttl if nobody pulls it.
func TestMockDisaggTransferExpiry(t *testing.T) {
	tm := startMock(t, withRole(router.RolePrefill, func(c *config) { c.KVTransferTTL = 50 * time.Millisecond }), true)
	a, _ := prefillStage(t, tm.url, promptIDs(1, 40))
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if status, _ := get(t, tm.url+"/kv/pull?transfer_id=nope"); status != http.StatusNotFound { // lookups expire records
			return fmt.Errorf("HTTP %d", status)
		}
		if st := statsOf(t, tm.url).KVTransfer; st.Expired != 1 || st.Pending != 0 {
			return fmt.Errorf("kv_transfer %+v", st)
		}
		return nil
	})
	if status, body := get(t, tm.url+"/kv/pull?transfer_id="+a.KV.TransferID); status != http.StatusNotFound {
		t.Fatalf("expired transfer: HTTP %d: %s", status, body)
	}
}

// A decode worker pulls the KV over the prefill worker's link; concurrent
// transfers share it fairly, or queue behind --link-max-transfers. At
// 10 MB/s and 114,688 B/token a 100-token transfer takes 1.147 s of link
// time, divided by --speedup. Both workers run in a synctest bubble over
// memNet, so the link's clock is the bubble's: every decode request starts
// its pull at the same instant, and the link times (the prefill side's
// seconds, X-Kvmock-Kv-Pull-Seconds) are the fluid model's, exactly, however
// loaded the host (docs/STYLE.md: no wall-clock bounds in tests).
func TestMockDisaggTransferTiming(t *testing.T) {
	const (
		speedup  = 5
		tokens   = 100
		linkMBps = 10
	)
	alone := tokens * 114688 * time.Second / (linkMBps * 1e6 * speedup) // 229.376 ms
	tests := []struct {
		name         string
		maxTransfers int
		concurrent   int
		want         []int // sorted link times, in multiples of alone
	}{
		{"one alone", 0, 1, []int{1}},
		{"four share the link", 0, 4, []int{4, 4, 4, 4}},
		{"four, one at a time", 1, 4, []int{1, 2, 3, 4}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				n := newMemNet()
				c := n.client(t)
				fast := func(c *config) { c.Speedup = speedup }
				p := startMock(t, withRole(router.RolePrefill, fast, func(c *config) {
					c.LinkMBps, c.LinkMaxTransfers = linkMBps, tc.maxTransfers
				}), true, n.serveOn)
				d := startMock(t, withRole(router.RoleDecode, fast), true, n.serveOn)
				prompts := make([][]uint32, tc.concurrent)
				kvs := make([]*kvTransferParams, tc.concurrent)
				for i := range prompts {
					prompts[i] = promptIDs(10000*(i+1), tokens)
					a, _ := prefillStageWith(t, c, p.url, prompts[i])
					kvs[i] = a.KV
				}
				results := make([]decodeResult, tc.concurrent)
				var wg sync.WaitGroup
				for i := range prompts {
					wg.Go(func() { results[i] = decodeStageWith(t, c, d.url, prompts[i], kvs[i], 2) })
				}
				wg.Wait()
				got := make([]time.Duration, len(results))
				for i, r := range results {
					if r.status != http.StatusOK || r.local != 0 || r.pulled != tokens || r.cached != tokens-1 || r.promptToks != tokens {
						t.Fatalf("decode %d: %+v %s", i, r, r.body)
					}
					// The request waits for its transfer (bubble time: exact).
					if r.wallS < r.linkS {
						t.Errorf("decode %d took %.9fs, less than its transfer %.9fs", i, r.wallS, r.linkS)
					}
					got[i] = time.Duration(math.Round(r.linkS * 1e9))
				}
				slices.Sort(got)
				t.Logf("link times: %v (alone %v; the first request's whole time %.6fs)", got, alone, results[0].wallS)
				// All pulls start at the same instant (the decode engine admits
				// remote prefills at once), so the fluid model's times are
				// multiples of the lone time, up to float rounding: four
				// sharing the link each get a quarter of it and end together at
				// 4×; one at a time they end at 1×, 2×, 3×, 4×.
				for i, w := range tc.want {
					if want := time.Duration(w) * alone; !nearDuration(got[i], want, 10*time.Nanosecond) {
						t.Errorf("transfer %d (sorted) took %v, want %d × %v = %v", i, got[i], w, alone, want)
					}
				}
				st := statsOfWith(t, c, p.url).KVTransfer
				wantPeak := tc.concurrent
				if tc.maxTransfers > 0 {
					wantPeak = tc.maxTransfers
				}
				if st.Sent != uint64(tc.concurrent) || st.SentBytes != uint64(tc.concurrent*tokens*114688) || st.InFlight != 0 || st.PeakLink != wantPeak {
					t.Errorf("prefill kv_transfer %+v (want peak %d)", st, wantPeak)
				}
				ds := statsOfWith(t, c, d.url)
				if ds.KVTransfer.Pulls != uint64(tc.concurrent) || ds.KVTransfer.PulledTokens != uint64(tc.concurrent*tokens) ||
					ds.KVTransfer.ReceivedTokens != uint64(tc.concurrent*tokens) || ds.Engine.PrefillTokens != uint64(tc.concurrent) {
					t.Errorf("decode stats: kv %+v, engine prefill tokens %d (want one per request)", ds.KVTransfer, ds.Engine.PrefillTokens)
				}
			})
		})
	}
}

// nearDuration: |a - b| ≤ tol.
func nearDuration(a, b, tol time.Duration) bool { return max(a-b, b-a) <= tol }

// A decode worker that already caches part of the prompt pulls only the
// rest; its answer counts every token it did not compute as cached.
func TestMockDisaggDecodeLocalPrefix(t *testing.T) {
	p := startMock(t, withRole(router.RolePrefill), true)
	d := startMock(t, withRole(router.RoleDecode), true)
	prefix := promptIDs(5000, 64)
	prompt := append(slices.Clone(prefix), promptIDs(9000, 36)...)
	// The decode worker serves a request with the same 64-token prefix
	// aggregated first (a decode worker can).
	if status, body := post(t, d.url+"/v1/completions", complBody(append(slices.Clone(prefix), 1, 2, 3), 1, false, nil)); status != 200 {
		t.Fatalf("warm-up: HTTP %d: %s", status, body)
	}
	tests := []struct {
		name                string
		wantLocal, wantPull int
	}{
		{"prefix cached", 64, 36},
		{"whole prompt cached but the last block", 96, 4}, // the previous decode stored its blocks
	}
	var sent uint64
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, _ := prefillStage(t, p.url, prompt)
			r := decodeStage(t, d.url, prompt, a.KV, 3)
			if r.status != http.StatusOK || r.local != tc.wantLocal || r.pulled != tc.wantPull || r.cached != len(prompt)-1 {
				t.Fatalf("decode %+v %s: want %d local, %d pulled, %d cached", r, r.body, tc.wantLocal, tc.wantPull, len(prompt)-1)
			}
			sent += uint64(tc.wantPull) * 114688
			if st := statsOf(t, p.url).KVTransfer; st.SentBytes != sent {
				t.Fatalf("prefill sent %d bytes, want %d", st.SentBytes, sent)
			}
		})
	}
}

// The decode stage streams like any request, and the blocks it received
// enter its KV events as stored blocks.
func TestMockDisaggDecodeStreamAndEvents(t *testing.T) {
	p := startMock(t, withRole(router.RolePrefill), true)
	d := startMock(t, withRole(router.RoleDecode), false)
	prompt := promptIDs(300, 100)
	a, _ := prefillStage(t, p.url, prompt)
	_, chunks, done := postStream(t, d.url+"/v1/completions", complBody(prompt, 5, true, a.KV))
	if !done || len(chunks) != 7 { // 5 tokens, finish, usage
		t.Fatalf("stream: done %v, %d chunks", done, len(chunks))
	}
	if u := chunks[len(chunks)-1].Usage; u == nil || u.PromptTokens != 100 || u.CompletionTokens != 5 || u.PromptTokensDetails.CachedTokens != 99 {
		t.Fatalf("usage %+v", u)
	}
	want := router.SequenceHashes(prompt, 16, "")
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		got := storedContent(d.pub.snapshot())
		if len(got) < len(want) || !slices.Equal(got[:len(want)], want) {
			return fmt.Errorf("stored %x, want the prompt's blocks %x first", got, want)
		}
		return nil
	})
}

// A failed pull is answered 502 kv_transfer_failed before any body byte,
// stream or not, and the request leaves the decode worker's engine.
func TestMockDisaggPullFailure(t *testing.T) {
	p := startMock(t, withRole(router.RolePrefill, func(c *config) { c.LinkMBps = 0.001 }), true) // 1 kB/s: a pull never ends
	broken := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "boom", http.StatusInternalServerError)
	}))
	defer broken.Close()
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	prompt := promptIDs(700, 50)
	slow, _ := prefillStage(t, p.url, prompt)
	tests := []struct {
		name   string
		kv     *kvTransferParams
		stream bool
		msg    string
	}{
		{"unknown transfer id", &kvTransferParams{DoRemotePrefill: true, TransferID: "nope", RemoteURL: p.url}, false, "HTTP 404"},
		{"unknown transfer id, stream", &kvTransferParams{DoRemotePrefill: true, TransferID: "nope", RemoteURL: p.url}, true, "HTTP 404"},
		{"prefill worker down", &kvTransferParams{DoRemotePrefill: true, TransferID: "x", RemoteURL: deadURL}, false, "refused"},
		{"prefill worker fails", &kvTransferParams{DoRemotePrefill: true, TransferID: "x", RemoteURL: broken.URL}, true, "HTTP 500"},
		{"pull times out", slow.KV, false, "deadline exceeded"},
	}
	d := startMock(t, withRole(router.RoleDecode, func(c *config) { c.KVPullTimeout = 300 * time.Millisecond }), true)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			status, h, body := postH(t, d.url+"/v1/completions", complBody(prompt, 4, tc.stream, tc.kv))
			var e struct {
				Error struct {
					Message, Type string
					Code          int
				}
			}
			if status != http.StatusBadGateway || !strings.HasPrefix(h.Get("Content-Type"), "application/json") ||
				json.Unmarshal(body, &e) != nil || e.Error.Type != "kv_transfer_failed" || e.Error.Code != 502 ||
				!strings.Contains(e.Error.Message, tc.msg) {
				t.Fatalf("HTTP %d %s: %s, want 502 kv_transfer_failed saying %q", status, h.Get("Content-Type"), body, tc.msg)
			}
		})
	}
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		ds := statsOf(t, d.url)
		if ds.KVTransfer.PullFailures != uint64(len(tests)) || ds.Engine.UsedBlocks != 0 || ds.KVTransfer.AwaitingKV != 0 || ds.Requests.InFlight != 0 {
			return fmt.Errorf("decode after failures: kv %+v, engine used blocks %d, in flight %d", ds.KVTransfer, ds.Engine.UsedBlocks, ds.Requests.InFlight)
		}
		// The timed-out pull was taken off the prefill worker's link.
		if ps := statsOf(t, p.url).KVTransfer; ps.Cancelled != 1 || ps.InFlight != 0 || ps.Sent != 0 {
			return fmt.Errorf("prefill after the timeout: %+v", ps)
		}
		return nil
	})
}

// The registration carries the role.
func TestMockRegisterRole(t *testing.T) {
	var (
		mu  sync.Mutex
		raw []byte
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/workers/register" {
			mu.Lock()
			raw = body
			mu.Unlock()
		}
		fmt.Fprint(w, `{}`)
	}))
	t.Cleanup(srv.Close) // after the mock's stop: it deregisters
	startMock(t, withRole(router.RoleDecode, func(c *config) { c.Register = []string{srv.URL} }), true)
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		var spec map[string]any
		if err := json.Unmarshal(raw, &spec); err != nil {
			return fmt.Errorf("registration %q: %v", raw, err)
		}
		if spec["role"] != "decode" || spec["id"] != "mock-1" {
			return fmt.Errorf("registration %s: want role decode", raw)
		}
		return nil
	})
}

func TestMockConfigDisagg(t *testing.T) {
	none := func(string) string { return "" }
	c, err := parseConfig(nil, none, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.Role != router.RoleBoth || c.KVBytesPerToken != 114688 || c.LinkMBps != 0 || c.LinkMaxTransfers != 0 ||
		c.KVPullTimeout != 30*time.Second || c.KVTransferTTL != 60*time.Second {
		t.Fatalf("defaults %+v", c)
	}
	env := map[string]string{"KVMOCK_ROLE": "prefill", "KVMOCK_LINK_MBPS": "104", "KVMOCK_LINK_MAX_TRANSFERS": "4"}
	c, err = parseConfig([]string{"--kv-bytes-per-token", "1000"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.Role != router.RolePrefill || c.LinkMBps != 104 || c.LinkMaxTransfers != 4 || c.KVBytesPerToken != 1000 {
		t.Fatalf("config %+v", c)
	}
	if c, err = parseConfig([]string{"--role", "decode"}, func(k string) string { return env[k] }, io.Discard); err != nil || c.Role != router.RoleDecode {
		t.Fatalf("the flag wins over KVMOCK_ROLE: %v %v", c.Role, err)
	}
	for _, args := range [][]string{
		{"--role", "decoder"}, {"--role", ""}, {"--kv-bytes-per-token", "0"}, {"--link-mbps", "-1"}, {"--link-mbps", "NaN"},
		{"--link-mbps", "+Inf"}, {"--link-max-transfers", "-1"}, {"--kv-pull-timeout", "0s"}, {"--kv-transfer-ttl", "-1s"},
	} {
		if _, err := parseConfig(args, none, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	if _, err := parseConfig(nil, func(k string) string {
		if k == "KVMOCK_ROLE" {
			return "sideways"
		}
		return ""
	}, io.Discard); err == nil || !strings.Contains(err.Error(), "sideways") {
		t.Errorf("bad KVMOCK_ROLE: %v", err)
	}
	// The command exits 2 on a bad flag, as for every configuration error.
	if code := run([]string{"--role", "sideways"}); code != 2 {
		t.Errorf("run with a bad role: exit %d, want 2", code)
	}
}
