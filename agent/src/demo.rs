//! `fort-agent demo`: a three-host fleet on loopback.

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Keep the fleet running after the walkthrough.
    #[arg(long)]
    pub keep: bool,
}

pub async fn run(_args: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("the demo is being written")
}
