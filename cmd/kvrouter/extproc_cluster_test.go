package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrouter/kvrouter/internal/poll"
)

// gatewayStream is one request's ext_proc stream, driven as Envoy drives
// it in FULL_DUPLEX_STREAMED mode.
type gatewayStream struct {
	t  *testing.T
	st extprocv3.ExternalProcessor_ProcessClient
}

func openGatewayStream(t *testing.T, ctx context.Context, c extprocv3.ExternalProcessorClient) *gatewayStream {
	t.Helper()
	st, err := c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &gatewayStream{t: t, st: st}
}

func (g *gatewayStream) send(m *extprocv3.ProcessingRequest) {
	g.t.Helper()
	if err := g.st.Send(m); err != nil {
		g.t.Fatalf("send: %v", err)
	}
}

func (g *gatewayStream) recv() *extprocv3.ProcessingResponse {
	g.t.Helper()
	r, err := g.st.Recv()
	if err != nil {
		g.t.Fatalf("recv: %v", err)
	}
	return r
}

// place sends the request phase and returns the destination list.
func (g *gatewayStream) place(body string) []string {
	g.t.Helper()
	hdrs := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/chat/completions")}, {Key: "content-type", RawValue: []byte("application/json")}}}
	g.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs}}})
	g.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: true}}})
	r := g.recv()
	var dest string
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
			dest = string(h.GetHeader().GetRawValue())
		}
	}
	if dest == "" {
		g.t.Fatalf("no destination: %v", r)
	}
	for !g.recv().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream() {
	}
	return strings.Split(dest, ",")
}

// relay sends the worker's answer through the response phase and ends the
// stream.
func (g *gatewayStream) relay(served string, status int, contentType string, body []byte) {
	g.t.Helper()
	md := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"envoy.lb": {Fields: map[string]*structpb.Value{
		"x-gateway-destination-endpoint-served": structpb.NewStringValue(served)}}}}
	g.send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(fmt.Sprint(status))},
			{Key: "content-type", RawValue: []byte(contentType)}}}}}})
	g.recv()
	g.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}})
	g.recv()
	_ = g.st.CloseSend()
	if _, err := g.st.Recv(); err != io.EOF {
		g.t.Fatalf("stream end: %v", err)
	}
}

// cachedOn is replica base's cached blocks per worker for body (its
// /debug/route table).
func cachedOn(base, body string) map[string]int {
	resp, err := http.Post(base+"/debug/route", "application/json", strings.NewReader(body))
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var doc struct {
		Workers []struct {
			Worker       string `json:"worker"`
			CachedBlocks int    `json:"cached_blocks"`
		} `json:"workers"`
	}
	if json.NewDecoder(resp.Body).Decode(&doc) != nil {
		return nil
	}
	out := map[string]int{}
	for _, w := range doc.Workers {
		out[w.Worker] = w.CachedBlocks
	}
	return out
}

// TestServeExtProcThreeReplicas is issue 30's active-active check: three
// replicas serve as one endpoint picker in front of three kvmock workers
// (a real process each, publishing KV events); a gateway spreads requests
// over the pickers and sends each to the worker picked. A prefix's second
// request, through another replica than its first, lands on the worker
// holding the prefix (one shared index, not one per picker). Then a
// request is placed through r3, booked everywhere through replica sync,
// and r3 is stopped with the stream open: the booking is freed on r1 and
// r2 (the cancelled exchange's release reaches them), none left for good.
func TestServeExtProcThreeReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("three in-process replicas and worker processes")
	}
	t.Parallel()
	bin := buildKvmock(t, t.TempDir())
	grpcPorts := freePorts(t, 3)
	reps := newTestCluster(t, func(c *serveConfig) {
		c.Models = []string{"kvmock"}
		i := int(c.NodeID[1] - '1')
		c.ExtProcAddr = fmt.Sprintf("127.0.0.1:%d", grpcPorts[i])
		c.DrainDelay, c.DrainTimeout = 0, 2*time.Second
	})
	poll.Until(t, 60*time.Second, 50*time.Millisecond, func() error { _, err := leaderOf(reps); return err })
	st, err := status(reps[0].url())
	if err != nil {
		t.Fatal(err)
	}
	workerAt := map[string]string{} // ip:port → worker id
	ports := freePorts(t, 3)
	for i, p := range ports {
		id := fmt.Sprintf("gw-%d", i+1)
		addr := fmt.Sprintf("127.0.0.1:%d", p)
		workerAt[addr] = id
		startKvmock(t, bin, "--id", id, "--addr", addr, "--model", "kvmock", "--speedup", "4",
			"--nats", st.NATS, "--register", reps[0].url()+","+reps[1].url(), "--log-level", "warn")
	}
	for _, r := range reps {
		for _, id := range workerAt {
			poll.Until(t, 30*time.Second, 50*time.Millisecond, func() error {
				if activeRequests(t, r.url(), id) < 0 {
					return fmt.Errorf("%s does not route to %s yet", r.cfg.NodeID, id)
				}
				return nil
			})
		}
	}
	clients := make([]extprocv3.ExternalProcessorClient, 3)
	for i, p := range grpcPorts {
		conn, err := grpc.NewClient(fmt.Sprintf("127.0.0.1:%d", p), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		clients[i] = extprocv3.NewExternalProcessorClient(conn)
	}
	ctx := t.Context()
	chat := func(prompt string) string {
		b, _ := json.Marshal(map[string]any{"model": "kvmock", "max_tokens": 4,
			"messages": []map[string]string{{"role": "user", "content": prompt}}})
		return string(b)
	}
	// through sends body through picker i, then to the worker it picked,
	// and relays the answer back through the picker: the worker answering.
	through := func(i int, body string) string {
		g := openGatewayStream(t, ctx, clients[i])
		dest := g.place(body)
		resp, err := http.Post("http://"+dest[0]+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		answer, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		g.relay(dest[0], resp.StatusCode, resp.Header.Get("Content-Type"), answer)
		if resp.StatusCode != 200 || !bytes.Contains(answer, []byte(`"usage"`)) {
			t.Fatalf("worker %s answered %d %s", dest[0], resp.StatusCode, answer)
		}
		return workerAt[dest[0]]
	}

	for k := range 4 {
		body := chat(fmt.Sprintf("conversation %d: %s", k, strings.Repeat(fmt.Sprintf("topic %d words to fill blocks ", k), 30)))
		first := through(k%3, body)
		// The holder's blocks reach every replica's index (KV events
		// through the bus and Raft), then the second request goes through
		// another replica.
		for _, r := range reps {
			poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
				if c := cachedOn(r.url(), body); c[first] == 0 {
					return fmt.Errorf("%s: %s's blocks not visible yet (%v)", r.cfg.NodeID, first, c)
				}
				return nil
			})
		}
		if second := through((k+1)%3, body); second != first {
			t.Fatalf("prefix %d: first request on %s (through r%d), second on %s (through r%d)", k, first, k%3+1, second, (k+1)%3+1)
		}
	}

	// A stream open on r3 when r3 stops.
	g := openGatewayStream(t, ctx, clients[2])
	dest := g.place(chat("held while its picker stops " + strings.Repeat("x ", 40)))
	w := workerAt[dest[0]]
	for _, r := range reps[:2] {
		poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
			if n := activeRequests(t, r.url(), w); n != 1 {
				return fmt.Errorf("%s books %d requests on %s, want the one placed through r3", r.cfg.NodeID, n, w)
			}
			return nil
		})
	}
	reps[2].stop()
	for _, r := range reps[:2] {
		poll.Until(t, 30*time.Second, 20*time.Millisecond, func() error {
			if n := activeRequests(t, r.url(), w); n != 0 {
				return fmt.Errorf("%s still books %d requests on %s after r3 stopped", r.cfg.NodeID, n, w)
			}
			return nil
		})
	}
}
