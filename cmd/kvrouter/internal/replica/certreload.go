package replica

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// certCheckEvery is how often a replica rereads its certificate files
// without being asked: a rotation by a tool that cannot signal the process
// (a Kubernetes Secret update, a cron job) lands within this long.
const certCheckEvery = time.Minute

// watchCertificate rotates the replica's certificate without a restart:
// on SIGHUP and every certCheckEvery it rereads the certificate and key
// files (pki.Bundle.Reload) and, when they hold a new valid certificate
// for this node under the same CA, every listener and dialer — Raft, the
// bus, HTTPS — presents it from its next handshake. A bad file (half
// written, another node's, another CA's) is refused loudly and the current
// certificate stays. The expiry is exported so an alert can fire before it.
func watchCertificate(ctx context.Context, b *pki.Bundle, reg prometheus.Registerer, log *slog.Logger) {
	reloads := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_tls_certificate_reloads_total",
		Help: "Rereads of this replica's certificate files by result: rotated (a new certificate is presented), unchanged, refused (kept the current one)."},
		[]string{"result"})
	expiry := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvrouter_tls_certificate_expiry_timestamp_seconds",
		Help: "When the certificate this replica presents expires (Unix seconds)."},
		func() float64 { return float64(b.NotAfter().Unix()) })
	if reg != nil {
		for _, c := range []prometheus.Collector{reloads, expiry} {
			if err := reg.Register(c); err != nil {
				log.Warn("certificate metrics not registered", "err", err)
			}
		}
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	tick := time.NewTicker(certCheckEvery)
	defer tick.Stop()
	for {
		why := "periodic check"
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-hup:
			why = "SIGHUP"
		}
		reloadCertificate(b, why, reloads, log)
	}
}

// reloadCertificate is one reread, logged and counted.
func reloadCertificate(b *pki.Bundle, why string, reloads *prometheus.CounterVec, log *slog.Logger) {
	changed, err := b.Reload()
	switch {
	case err != nil:
		reloads.WithLabelValues("refused").Inc()
		log.Error("certificate files not reloaded; the current certificate stays", "trigger", why, "err", err,
			"expires", b.NotAfter())
	case changed:
		reloads.WithLabelValues("rotated").Inc()
		log.Info("certificate rotated: new handshakes present the new one", "trigger", why,
			"cert", b.Material().CertFile, "expires", b.NotAfter())
	default:
		reloads.WithLabelValues("unchanged").Inc()
		if why == "SIGHUP" {
			log.Info("certificate files unchanged", "cert", b.Material().CertFile, "expires", b.NotAfter())
		}
	}
}
