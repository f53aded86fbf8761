package api

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/api/tokenize"
	"github.com/kvrouter/kvrouter/router"
)

// BenchmarkAPIProxyTLS is the proxy's added time to first token with TLS on
// both legs (issue 31 item 4): client → Server over HTTPS, Server → worker
// over HTTPS (Config.WorkerTLS), keep-alive connections both ways, against
// the same HTTPS worker called directly. The worker answers like kvmock
// (headers flushed at once, the first token's chunk on its own); the
// prompts are kvbench load's default shape (2,032-token shared prefix,
// 339-token tail, builtin words, /v1/completions, stream). The replica
// around the Server (Raft, the bus) is BenchmarkServeProxyOverhead's, in
// cmd/kvrouter: this one isolates the HTTP layer and TLS.
func BenchmarkAPIProxyTLS(b *testing.B) {
	worker := httptest.NewTLSServer(http.HandlerFunc(benchWorker))
	b.Cleanup(worker.Close)
	roots := x509.NewCertPool()
	roots.AddCert(worker.Certificate())
	rep := newFakeReplica("m", router.DefaultConfig())
	rep.addWorker("m", "w1", worker.URL)
	s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, WorkerTLS: &tls.Config{RootCAs: roots}}, rep)
	front := httptest.NewTLSServer(s.Handler())
	b.Cleanup(front.Close)
	client := func(srv *httptest.Server) *http.Client {
		c := srv.Client()
		c.Transport.(*http.Transport).DisableCompression = true
		return c
	}
	bodies := benchBodies()
	for _, tc := range []struct {
		name string
		base string
		hc   *http.Client
	}{{"direct-https", worker.URL, client(worker)}, {"replica-https-both", front.URL, client(front)}} {
		b.Run(tc.name, func(b *testing.B) {
			ttfts := make([]time.Duration, 0, b.N)
			i := 0
			for b.Loop() {
				ttfts = append(ttfts, benchComplete(b, tc.hc, tc.base, bodies[i%len(bodies)]))
				i++
			}
			slices.Sort(ttfts)
			b.ReportMetric(float64(ttfts[len(ttfts)/2].Nanoseconds())/1e3, "ttft-µs")
		})
	}
}

// benchComplete sends one streamed completion and reads it to its end; it
// returns the time to the first data line.
func benchComplete(b *testing.B, hc *http.Client, base string, body []byte) time.Duration {
	req, err := http.NewRequest(http.MethodPost, base+"/v1/completions", strings.NewReader(string(body)))
	if err != nil {
		b.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := hc.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		b.Fatalf("HTTP %d: %s", resp.StatusCode, msg)
	}
	br := bufio.NewReader(resp.Body)
	var ttft time.Duration
	for {
		line, err := br.ReadString('\n')
		if ttft == 0 && strings.HasPrefix(line, "data:") {
			ttft = time.Since(start)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	return ttft
}

// benchBodies are kvbench load's default requests: one shared prefix of
// builtin words, 64 different tails.
func benchBodies() [][]byte {
	tok := tokenize.Builtin()
	rng := rand.New(rand.NewPCG(31, 4))
	word := func() uint32 { return 384 + uint32(rng.IntN(tokenize.BuiltinVocabSize-384)) }
	prefix := make([]uint32, 2032)
	for i := range prefix {
		prefix[i] = word()
	}
	var out [][]byte
	for range 64 {
		ids := slices.Clone(prefix)
		for range 339 {
			ids = append(ids, word())
		}
		body, _ := json.Marshal(map[string]any{"model": "m", "prompt": tok.Decode(ids), "max_tokens": 4,
			"stream": true, "stream_options": map[string]bool{"include_usage": true}})
		out = append(out, body)
	}
	return out
}

// benchWorker streams a completion as kvmock does, taking no time to
// generate: what is measured is the HTTP layer.
func benchWorker(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Prompt string `json:"prompt"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	f := w.(http.Flusher)
	f.Flush()
	const chunk = `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" w%d","finish_reason":null}]}` + "\n\n"
	fmt.Fprintf(w, chunk, 0)
	f.Flush()
	for i := 1; i < 4; i++ {
		fmt.Fprintf(w, chunk, i)
	}
	fmt.Fprint(w, `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":2371,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":2032}}}`+"\n\ndata: [DONE]\n\n")
	f.Flush()
}

// TestAPIWorkerTLS: an https:// worker is reached through Config.WorkerTLS
// (its CA trusted), and refused as a connection failure without it (the
// system roots do not know a test certificate).
func TestAPIWorkerTLS(t *testing.T) {
	worker := httptest.NewTLSServer(http.HandlerFunc(benchWorker))
	defer worker.Close()
	roots := x509.NewCertPool()
	roots.AddCert(worker.Certificate())
	body := `{"model":"m","prompt":"bakemo dubiza","stream":true}`
	for _, tc := range []struct {
		name string
		conf *tls.Config
		want int
	}{{"trusted", &tls.Config{RootCAs: roots}, http.StatusOK}, {"system roots", nil, http.StatusBadGateway}} {
		rep := newFakeReplica("m", router.DefaultConfig())
		rep.addWorker("m", "w1", worker.URL)
		s := New(Config{Registry: prometheus.NewRegistry(), AllowLoopbackWorkers: true, WorkerTLS: tc.conf}, rep)
		if rec := do(s, "POST", "/v1/completions", body); rec.Code != tc.want {
			t.Errorf("%s: %d %s, want %d", tc.name, rec.Code, rec.Body, tc.want)
		}
	}
}
